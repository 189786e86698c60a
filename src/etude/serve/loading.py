"""What ``etude serve PATH`` serves: a model, its tokenizer and a name, from one path.

PATH may be:

- an etude run directory (``etude pretrain``/``sft``/``train``): ``export/model.safetensors``,
  ``export/config.json`` and ``tokenizer/tokenizer.json``;
- an etude export directory (``model.safetensors`` + ``config.json``), the tokenizer in
  ``PATH/tokenizer`` or ``PATH/../tokenizer``;
- a checkpoint step directory of a run (``RUN/checkpoints/step_N`` with ``extra.json``): the
  model shape from ``RUN/export/config.json``, the weights from the DCP checkpoint;
- a Hugging Face checkpoint directory (``config.json`` with ``architectures``, safetensors
  shards), converted by ``etude.parallel.checkpoint.load_hf_checkpoint``.

The chat format (``Served.chat_format``) is the model's own: the one ``etude model import``
recorded (``hf_source.json``) or ``etude.model.chat_family.detect_chat_format`` finds in the
tokenizer files (Kimi K2's or DeepSeek-V3's markers, Qwen's ChatML: ``hermes``), with the
tokenizer that format needs (``load_chat_tokenizer``); a directory of etude's own speaks
``etude``. A Hugging Face tokenizer with the ChatML markers but no family sign also speaks
``etude``; any other tokenizer only decodes text, and the model serves ``/v1/completions`` with
token ids.

Not here: GGUF or other formats, quantized serving, downloading anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from etude.env.episode_chat import end_of_turn_id
from etude.model.chat_family import (
    SOURCE_FILE,
    detect_chat_format,
    load_chat_tokenizer,
)
from etude.model.tokenizer import Tokenizer
from etude.model.transformer import Transformer


@dataclass(kw_only=True, slots=True)
class Served:
    """A loaded model ready to be served."""

    model: Transformer
    name: str
    tokenizer: Any
    """The chat format's tokenizer (etude's `Tokenizer` for ``etude``/``hermes``, a marker
    tokenizer for the families); None when the checkpoint has no chat format etude speaks."""
    chat_format: str | None
    """The model's chat format (``etude.model.chat_family.CHAT_FORMATS``), None without one."""
    decode: Callable[[list[int]], str] | None
    """Ids -> text for the ``text`` fields and stop strings (None: no tokenizer at all)."""
    stop_token_ids: tuple[int, ...]
    """Ids that end an assistant message (the chat format's end of turn); empty when unknown."""
    source: Path


def _model_config(path: Path):
    from etude.config import from_dict
    from etude.model.config import ModelConfig

    return from_dict(ModelConfig, json.loads(path.read_text()), "model")


def _etude_tokenizer(*dirs: Path) -> Tokenizer | None:
    for d in dirs:
        if (d / "tokenizer.json").is_file():
            return Tokenizer.load(d)
    return None


def load_served(path: str | Path, *, device: str = "cpu", name: str = "") -> Served:
    """Load PATH (see the module docstring) onto ``device`` in eval mode."""
    from etude.model.transformer import build_model
    from etude.parallel.checkpoint import load_checkpoint, load_safetensors

    source = Path(path).resolve()
    if not source.is_dir():
        raise ValueError(f"{path}: not a directory; pass a run, export, checkpoint or HF directory")
    tokenizer: Any = None
    chat_format: str | None = "etude"
    decode = None
    if (source / SOURCE_FILE).is_file():  # `etude model import`: the recorded format
        model = build_model(_model_config(source / "export" / "config.json"), device=device, seed=0)
        load_safetensors(model, source / "export" / "model.safetensors")
        chat_format, tokenizer = _family_tokenizer(source)
        if tokenizer is None:
            decode = _decode_only(source / "tokenizer")
    elif (source / "export" / "model.safetensors").is_file():
        model = build_model(_model_config(source / "export" / "config.json"), device=device, seed=0)
        load_safetensors(model, source / "export" / "model.safetensors")
        tokenizer = _etude_tokenizer(source / "tokenizer")
    elif (source / "extra.json").is_file():
        # RUN/checkpoints/step_N (or a step directory placed right under the run)
        runs = [source.parent.parent, source.parent]
        run = next((r for r in runs if (r / "export" / "config.json").is_file()), None)
        if run is None:
            raise ValueError(
                f"{source} is a checkpoint, but its run has no export/config.json (the model "
                "shape); serve the run directory after it exported once"
            )
        model = build_model(_model_config(run / "export" / "config.json"), device=device, seed=0)
        load_checkpoint(source, model)
        tokenizer = _etude_tokenizer(run / "tokenizer")
    elif (source / "model.safetensors").is_file() and not _is_hf(source):
        model = build_model(_model_config(source / "config.json"), device=device, seed=0)
        load_safetensors(model, source / "model.safetensors")
        tokenizer = _etude_tokenizer(source / "tokenizer", source.parent / "tokenizer")
    elif _is_hf(source):
        from etude.model.hf_config import model_config_from_hf
        from etude.parallel.checkpoint import load_hf_checkpoint, read_hf_config

        cfg, _ = model_config_from_hf(read_hf_config(source))
        with torch.device("meta"):
            model = Transformer(cfg)
        load_hf_checkpoint(model, source, device=device)
        chat_format, tokenizer = _family_tokenizer(source)
        if tokenizer is None and (source / "tokenizer.json").is_file():
            from etude.model.hf_tokenizer import load_hf_tokenizer

            try:  # ChatML markers as single ids, no family sign: etude's chat format
                tokenizer, chat_format = load_hf_tokenizer(source), "etude"
            except ValueError:  # no format etude speaks: token ids in and out, text decoded
                decode = _decode_only(source)
    else:
        raise ValueError(
            f"{source}: no model found; pass a run directory (export/model.safetensors), an "
            "export directory (model.safetensors + config.json), a checkpoint step directory "
            "(extra.json) or a Hugging Face directory (config.json with architectures)"
        )
    if tokenizer is not None:
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                f"{model.cfg.vocab_size}; serve the tokenizer the model was trained with"
            )
        decode = tokenizer.decode
    else:
        chat_format = None
    model.eval().requires_grad_(False)
    return Served(
        model=model,
        name=name or source.name,
        tokenizer=tokenizer,
        decode=decode,
        chat_format=chat_format,
        stop_token_ids=(end_of_turn_id(chat_format, tokenizer),) if chat_format else (),
        source=source,
    )


def _decode_only(directory: Path) -> Callable[[list[int]], str] | None:
    """Ids -> text with a directory's ``tokenizer.json`` (None without one)."""
    if not (directory / "tokenizer.json").is_file():
        return None
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    return lambda ids: backend.decode(ids, skip_special_tokens=False)


def _family_tokenizer(source: Path) -> tuple[str | None, Any]:
    """(chat format, its tokenizer) of a model directory, or (None, None) when no format is
    recorded or found."""
    try:
        chat_format = detect_chat_format(source)
    except ValueError:
        return None, None
    return chat_format, load_chat_tokenizer(source, chat_format)


def _is_hf(path: Path) -> bool:
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        return "architectures" in json.loads(config.read_text())
    except ValueError:
        return False
