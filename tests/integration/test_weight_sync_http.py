"""Weight sync over HTTP to a real ``etude serve``: after every optimizer step the served model
gives the trainer's logprobs (HTTP backend against the trainer's own forward)."""

from __future__ import annotations

import torch

from etude.config import to_dict
from etude.engine import SamplingParams
from etude.engine.backends import GenerationRequest, HTTPBackend, HTTPBackendConfig
from etude.model.config import ModelConfig
from etude.model.tokenizer import Tokenizer, default_corpus
from etude.model.transformer import build_model
from etude.optim import OptimConfig, build_optimizer
from etude.parallel.checkpoint import export_safetensors
from etude.rl.server_process import ServerProcess
from etude.rl.weight_sync import WeightSyncConfig, build_weight_sync


def served_logprobs(backend: HTTPBackend, prompt: list[int]) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    out = backend.generate([GenerationRequest(prompt_ids=prompt, params=params)])[0]
    return out.token_ids, out.logprobs


def local_logprobs(model, prompt: list[int], generated: list[int]) -> list[float]:
    ids = torch.tensor([prompt + generated])
    model.eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].float(), dim=-1)
    model.train()
    n = len(prompt)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(generated)]


def test_served_logprobs_follow_every_step(tmp_path) -> None:
    tok = Tokenizer.train(default_corpus(100_000), 300)
    cfg = ModelConfig.preset("micro", vocab_size=tok.vocab_size, max_seq_len=256)
    model = build_model(cfg, seed=0)
    export_safetensors(model, tmp_path / "run" / "export", to_dict(cfg))
    tok.save(tmp_path / "run" / "tokenizer")
    optimizer = build_optimizer(model, OptimConfig(name="muon", lr=0.02))
    prompt = tok.encode("def add(a, b):\n    return")
    with ServerProcess(tmp_path / "run", log_path=tmp_path / "serve.log") as server:
        backend = HTTPBackend(HTTPBackendConfig(url=server.url))
        sync = build_weight_sync(
            WeightSyncConfig(kind="http", track_changes=True),
            backend=backend,
            model_config=to_dict(cfg),
            run_dir=tmp_path,
        )
        previous = None
        for step in range(1, 4):
            ids = torch.randint(
                0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(step)
            )
            loss = torch.nn.functional.cross_entropy(
                model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            record = sync.push(model, step)
            assert backend.policy_version == step and record.seconds > 0
            generated, served = served_logprobs(backend, prompt)
            expected = local_logprobs(model, prompt, generated)
            assert max(abs(a - b) for a, b in zip(served, expected)) < 1e-5
            if previous is not None:
                assert served != previous  # the weights did move between versions
            previous = served
        backend.close()
