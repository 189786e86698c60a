"""Episodes in an imported model's own chat format: a tiny checkpoint of each family (Kimi K2,
DeepSeek-V3, Qwen/Hermes) is imported, and its coding episodes are checked turn by turn against
the family's chat template as transformers renders it (the reference templates of
``test_kimi_chat``, ``test_deepseek_chat`` and ``test_hf_chat``), with their tool calls parsed
in the family's syntax, malformed calls and no-call turns answered in it, and a real rollout of
the imported model stopping at the family's end of turn."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

import test_deepseek_chat as deepseek_ref  # noqa: E402
import test_hf_chat as hermes_ref  # noqa: E402
import test_kimi_chat as kimi_ref  # noqa: E402
import torch  # noqa: E402
from test_hf_parity import hf_model  # noqa: E402
from test_kimi_chat import marker_backend  # noqa: E402

from etude.engine import Engine  # noqa: E402
from etude.env.coding import CodingEnv, EnvConfig  # noqa: E402
from etude.env.episode_chat import no_tool_call_message  # noqa: E402
from etude.env.pool import EnvPool  # noqa: E402
from etude.env.tools import tool_schemas  # noqa: E402
from etude.env.trajectory import ToolCall  # noqa: E402
from etude.model import deepseek_chat as ds  # noqa: E402
from etude.model.chat_family import detect_chat_format, load_chat_tokenizer  # noqa: E402
from etude.model.deepseek_chat import DEEPSEEK_MARKERS  # noqa: E402
from etude.model.kimi_chat import KIMI_MARKERS  # noqa: E402
from etude.model.tokenizer import SPECIAL_TOKENS  # noqa: E402
from etude.parallel.checkpoint import import_hf, load_safetensors  # noqa: E402
from etude.rl.rollout import RolloutConfig, collect_rollouts  # noqa: E402
from etude.tasks.record import EtudeInfo, TaskRecord  # noqa: E402

INSTRUCTIONS = "You fix bugs. Act through the tools."
PROBLEM = "Add `mul(a, b)` to pkg/core.py."
CORE = "def add(a, b):\n    return a + b\n"
TEXTS = [CORE, PROBLEM, INSTRUCTIONS, '{"path": "pkg/core.py"}', "```json\n{}\n```"] * 20 + [
    json.dumps(tool_schemas())
] * 5

# family -> (its markers, the transformers config to import, the reference template)
FAMILIES = {
    "kimi_k2": (KIMI_MARKERS, "deepseek_v3_q_lora", kimi_ref.TEMPLATE),
    "deepseek_v3": (DEEPSEEK_MARKERS, "deepseek_v3_no_q_lora", deepseek_ref.TEMPLATE),
    # Qwen's ChatML markers after another token: a published tokenizer, not one etude trained
    "hermes": (("<|other|>", *SPECIAL_TOKENS), "qwen3_moe", hermes_ref.TEMPLATE),
}
END = {"kimi_k2": "<|im_end|>", "deepseek_v3": ds.EOS, "hermes": "<|im_end|>\n"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
    """(format, the import's directory, its chat tokenizer, the reference HF tokenizer)."""
    name = request.param
    markers, config, template = FAMILIES[name]
    hf_dir = tmp_path_factory.mktemp(f"hf-{name}")
    hf_model(config).save_pretrained(hf_dir)
    backend = marker_backend(markers, TEXTS, vocab_size=300)
    backend.save(str(hf_dir / "tokenizer.json"))
    if name == "hermes":  # Qwen's model type names the family of a ChatML tokenizer
        config_json = json.loads((hf_dir / "config.json").read_text())
        assert config_json["model_type"] == "qwen3_moe"
    out = tmp_path_factory.mktemp(f"model-{name}")
    report = import_hf(hf_dir, out)
    assert report["chat_format"] == name == detect_chat_format(out)
    tok = load_chat_tokenizer(out, name)
    extra = {"bos_token": ds.BOS} if name == "deepseek_v3" else {}
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=template, **extra
    )
    return name, out, tok, hf_tok


@pytest.fixture
def task(tmp_path) -> TaskRecord:
    ws = tmp_path / "task"
    (ws / "pkg").mkdir(parents=True)
    (ws / "tests").mkdir()
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "core.py").write_text(CORE)
    (ws / "tests" / "test_core.py").write_text(
        "from pkg import core\n\n\ndef test_add():\n    assert core.add(1, 2) == 3\n\n\n"
        "def test_mul():\n    assert core.mul(2, 3) == 6\n"
    )
    (ws / "pyproject.toml").write_text('[tool.pytest.ini_options]\npythonpath = ["."]\n')
    return TaskRecord(
        instance_id="tiny__mul",
        problem_statement=PROBLEM,
        FAIL_TO_PASS=["tests/test_core.py::test_mul"],
        PASS_TO_PASS=["tests/test_core.py::test_add"],
        etude=EtudeInfo(workspace=str(ws), kind="handwritten"),
    )


def env_config(tmp_path, **overrides) -> EnvConfig:
    work = tmp_path / "episodes"
    work.mkdir(exist_ok=True)
    fields = dict(max_turns=20, instructions=INSTRUCTIONS, work_dir=str(work))
    return EnvConfig(**{**fields, **overrides})


def end_id(name: str, tok) -> int:
    return tok.im_end_id if name == "hermes" else tok.token_to_id(END[name])


def render(hf_tok, messages, *, prompt: bool) -> str:
    return hf_tok.apply_chat_template(
        messages, tools=tool_schemas(), tokenize=False, add_generation_prompt=prompt
    )


def check_conversation(env: CodingEnv, hf_tok, messages, *, plain: str = "") -> None:
    """The env's ids equal the template's rendering of ``messages`` and its tokenization.

    ``plain``: a message content holding marker strings, which the env writes as plain text
    (untrusted text can not forge a marker) and the template's tokenization as marker ids; the
    ids are compared with that content tokenized as plain text.
    """
    chat = env.chat
    pending = [] if not env.done else chat.conversation.pending_close_ids()
    want = render(hf_tok, messages, prompt=not env.done)
    assert chat.tokenizer.decode(chat.ids + pending) == want
    if plain:
        head, tail = want.split(plain)
        pieces = [hf_tok(part, add_special_tokens=False)["input_ids"] for part in (head, tail)]
        want_ids = pieces[0] + chat.tokenizer.encode(plain) + pieces[1]
    else:
        want_ids = hf_tok(want, add_special_tokens=False)["input_ids"]
    assert chat.ids + pending == want_ids
    # the turns tile the conversation (all but the open generation prompt while it runs)
    recorded = env.trajectory.token_ids
    assert recorded == chat.ids if env.done else recorded == chat.ids[: len(recorded)]


def call(name: str, index: int, **arguments) -> dict:
    return {
        "id": f"functions.{name}:{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def assistant_text(name: str, hf_tok, messages, reply) -> str:
    """What the model writes for ``reply``: the template's rendering of it after ``messages``,
    without the generation prompt before it and the end of turn after it."""
    before = render(hf_tok, messages, prompt=True)
    after = render(hf_tok, [*messages, reply], prompt=False)
    assert after.startswith(before)
    text = after[len(before) :]
    assert text.endswith(END[name])
    return text.removesuffix(END[name])


def test_scripted_episode_matches_the_template_turn_by_turn(imported, task, tmp_path):
    name, _, tok, hf_tok = imported
    reminder = no_tool_call_message(name)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": PROBLEM}]
    with CodingEnv(task, env_config(tmp_path), tokenizer=tok, chat_format=name) as env:
        env.reset()
        assert env.stop_token_ids == (end_id(name, tok),)
        check_conversation(env, hf_tok, messages)

        # two parallel calls in the family's own syntax, each answered in order
        reply = {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [call("read_file", 0, path="pkg/core.py"), call("list_files", 1)],
        }
        result = env.step(assistant_text(name, hf_tok, messages, reply))
        assert result.tool_calls == [
            ToolCall(name="read_file", arguments={"path": "pkg/core.py"}),
            ToolCall(name="list_files", arguments={}),
        ]
        assert result.errors == [] and "return a + b" in result.observations[0]
        messages.append(reply)
        for c, observation in zip(reply["tool_calls"], result.observations):
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": observation})
        check_conversation(env, hf_tok, messages)

        # a turn without a call: the reminder names the family's syntax
        reply = {"role": "assistant", "content": "Thinking."}
        result = env.step(assistant_text(name, hf_tok, messages, reply))
        assert [e.kind for e in result.errors] == ["no_tool_call"]
        assert result.observations == [reminder]
        messages += [reply, {"role": "user", "content": reminder}]
        check_conversation(env, hf_tok, messages)

        # the fix, then submit: the workspace changes and the episode ends
        new = CORE + "\n\ndef mul(a, b):\n    return a * b\n"
        fix = call("replace_in_file", 0, path="pkg/core.py", old=CORE, new=new)
        reply = {"role": "assistant", "content": "", "tool_calls": [fix, call("submit", 1)]}
        result = env.step(assistant_text(name, hf_tok, messages, reply))
        assert [c.name for c in result.tool_calls] == ["replace_in_file", "submit"]
        assert result.done and result.finish_reason == "submit"
        assert (env.workspace / "pkg" / "core.py").read_text() == new
        messages.append(reply)
        for c, observation in zip(reply["tool_calls"], result.observations):
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": observation})
        check_conversation(env, hf_tok, messages)
        trajectory = env.finish()
    assert trajectory.reward == 1.0 and trajectory.info["chat_format"] == name


def test_malformed_call_is_an_observation_in_the_family_format(imported, task, tmp_path):
    name, _, tok, hf_tok = imported
    bad = {
        "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0"
        '<|tool_call_argument_begin|>{"path": <|tool_call_end|><|tool_calls_section_end|>',
        "deepseek_v3": f"{ds.CALLS_BEGIN}{ds.CALL_BEGIN}function{ds.SEP}read_file\n```json\n"
        f'{{"path": \n```{ds.CALL_END}{ds.CALLS_END}',
        "hermes": '<tool_call>\n{"name": "read_file", "arguments": {"path": }\n</tool_call>',
    }[name]
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": PROBLEM}]
    with CodingEnv(task, env_config(tmp_path), tokenizer=tok, chat_format=name) as env:
        env.reset()
        result = env.step(bad)
        assert [e.kind for e in result.errors] == ["malformed_json"]
        assert result.errors[0].tool == "read_file" and result.tool_calls == []
        assert result.observations[0].startswith("Malformed tool call")
        messages.append({"role": "assistant", "content": bad})
        # Kimi names the call a result answers: a malformed one by its position in the turn
        messages.append(
            {"role": "tool", "tool_call_id": "functions.read_file:0", "content": result.observation}
        )
        # where the message shows the family's syntax, its markers are plain text
        shown = any(marker in result.observation for marker in FAMILIES[name][0])
        check_conversation(env, hf_tok, messages, plain=result.observation if shown else "")


def test_compact_declarations_are_etude_format_only(imported, task, tmp_path):
    name, _, tok, _ = imported
    cfg = env_config(tmp_path, tool_declarations="compact")
    with pytest.raises(ValueError, match="env.tool_declarations='compact' is etude's own format"):
        CodingEnv(task, cfg, tokenizer=tok, chat_format=name)


def test_rollout_of_the_imported_model_in_its_format(imported, task, tmp_path):
    """The imported model, its head set to end every turn at once, rolls out through the
    engine: prompts are the family's rendering, generation stops at the family's end id, the
    generated ids stand verbatim, and the no-call turn gets the family's reminder."""
    name, out, tok, hf_tok = imported
    from etude.config import from_dict
    from etude.model.config import ModelConfig
    from etude.model.transformer import build_model

    fields = json.loads((out / "export" / "config.json").read_text())
    cfg = from_dict(ModelConfig, {**fields, "max_seq_len": 4096}, "model")
    model = build_model(cfg, seed=0)
    load_safetensors(model, out / "export" / "model.safetensors")
    end = end_id(name, tok)
    assert not cfg.tie_embeddings
    with torch.no_grad():  # one residual direction, read only by the end id's head row
        model.tok_embeddings.weight[:, 0] = 1000.0
        model.output.weight.zero_()
        model.output.weight[end, 0] = 10.0
    engine = Engine(model.eval(), max_seq_len=4096, decode_fn=tok.decode)
    rollout = RolloutConfig(tasks_per_step=1, group_size=1, max_new_tokens=8)
    env_cfg = env_config(tmp_path, max_turns=2, max_tokens=4000)
    with EnvPool(env_cfg, tokenizer=tok, base_dir=tmp_path, chat_format=name) as pool:
        assert pool.stop_token_ids == (end,)
        (trajectory,), _ = collect_rollouts(engine, pool, [task], rollout, seed=0, step=0)
    assert trajectory.finish_reason == "max_turns"
    assistants = [t for t in trajectory.turns if t.role == "assistant"]
    assert [[i for i, m in zip(t.token_ids, t.trainable) if m] for t in assistants] == [[end]] * 2
    reminder = no_tool_call_message(name)
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": PROBLEM},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": reminder},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": reminder},  # the last turn is answered too
    ]
    want = render(hf_tok, messages, prompt=False)
    assert trajectory.token_ids == hf_tok(want, add_special_tokens=False)["input_ids"]


def test_rl_trainer_takes_only_the_formats_it_trains(imported):
    from etude.rl.pipeline import make_env_pool
    from etude.rl.trainer import TrainConfig

    name, out, tok, _ = imported
    if name == "hermes":  # ChatML: hints, SFT data and export work as for etude's models
        assert TrainConfig(init=str(out)).init == str(out)
    else:
        with pytest.raises(ValueError, match=f"speaks the {name} chat format"):
            TrainConfig(init=str(out))
    with pytest.raises(ValueError, match="rollout.workers='ray' renders etude's chat format"):
        make_env_pool(
            RolloutConfig(workers="ray"), EnvConfig(), tokenizer=tok, base_dir=".", chat_format=name
        )
