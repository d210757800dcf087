"""GGUF targets: the one code path that reads a ``.gguf`` file into a Hugging Face model and tokenizer.

transformers dequantises every tensor of the file (Q4_1, Q8_0, ...) to the dtype asked for when
``from_pretrained(folder, gguf_file=name)`` is called; the ``gguf`` package does the reading. The
float model it gives is the target whose distribution eagle-tree preserves (docs/EXACTNESS.md,
"GGUF targets"): the quantized file defines the weights, the float forward defines the law.

What this module adds to that call:

* a clear error naming the install command when ``gguf`` is missing;
* the special tokens checked against the file's own ``tokenizer.ggml.*`` metadata (the converter has
  been known to swap bos and eos), and corrected from it when they differ;
* :func:`convert_gguf`: a Hugging Face folder (safetensors, tokenizer with its chat template,
  generation config) written once, with ``gguf_source.json`` recording the file's sha256 and the
  library versions, so later loads take 2 s instead of a dequantisation.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

GGUF_INSTALL = "pip install 'gguf>=0.10'"
SOURCE_RECORD = "gguf_source.json"

__all__ = ["GGUF_INSTALL", "SOURCE_RECORD", "GGUFError", "require_gguf", "gguf_metadata", "load_gguf_model",
           "load_gguf_tokenizer", "convert_gguf", "sha256_file", "is_gguf", "load_causal_lm", "load_tokenizer"]


class GGUFError(ValueError):
    """A GGUF file that cannot be read, or a missing library; the message names the fix."""


def require_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise GGUFError(f"reading a GGUF file needs the 'gguf' package: {GGUF_INSTALL}") from exc
    return gguf


def _split(path: str | os.PathLike, gguf_file: str | None) -> tuple[Path, str]:
    """(folder, file name) for a path to a ``.gguf`` file, or a folder plus ``gguf_file``."""
    path = Path(path)
    if gguf_file is None:
        if path.suffix != ".gguf":
            raise GGUFError(f"{path} is not a .gguf file: pass the file itself, or its folder and gguf_file=NAME")
        path, gguf_file = path.parent, path.name
    file = path / gguf_file
    if not file.is_file():
        raise GGUFError(f"GGUF file {file} does not exist")
    return path, gguf_file


def gguf_metadata(file: str | os.PathLike) -> dict:
    """The scalar metadata of a GGUF file (architecture, special token ids, context length, ...)."""
    gguf = require_gguf()
    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as exc:  # the reader raises ValueError / struct errors on foreign or truncated files
        raise GGUFError(f"{file} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "scores", "token_type", "merges")):
            continue
        try:
            value = field.contents()
        except Exception:  # a field whose type the reader cannot decode; not one we use
            continue
        if isinstance(value, int | float | str | bool):
            out[key] = value
    return out


def load_gguf_model(path: str | os.PathLike, gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
                    **kwargs):
    """``AutoModelForCausalLM`` from a GGUF file, dequantised to ``dtype``, with the GGUF quantization
    config removed (the weights are plain tensors now), in eval mode."""
    from transformers import AutoModelForCausalLM

    require_gguf()
    folder, name = _split(path, gguf_file)
    gguf_metadata(folder / name)  # a readable file, or a GGUFError naming it (transformers' errors name no file)
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=dtype, **kwargs)
    _drop_quantization(model)
    return model.eval()


def _drop_quantization(model) -> None:
    """The loaded model holds dequantised tensors; its GGUF quantizer would only block saving."""
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            try:
                delattr(obj, "quantization_config")
            except AttributeError:
                pass
    for attr in ("hf_quantizer", "is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None


def load_gguf_tokenizer(path: str | os.PathLike, gguf_file: str | None = None):
    """The file's tokenizer, its bos / eos / pad / unk ids checked against ``tokenizer.ggml.*`` and
    set from the metadata where the converter disagrees."""
    from transformers import AutoTokenizer

    folder, name = _split(path, gguf_file)
    meta = gguf_metadata(folder / name)  # first: needs gguf and a readable file (transformers' errors name neither)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    for role in ("bos", "eos", "padding", "unknown"):
        key = f"tokenizer.ggml.{role}_token_id"
        if key not in meta:
            continue
        want = int(meta[key])
        attr = {"padding": "pad", "unknown": "unk"}.get(role, role)
        if getattr(tokenizer, f"{attr}_token_id") != want:
            setattr(tokenizer, f"{attr}_token", tokenizer.convert_ids_to_tokens(want))
    return tokenizer


def sha256_file(path: str | os.PathLike, block: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def library_versions() -> dict:
    import gguf
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf")}


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


CHECK_TEXT = "Speculative decoding checks a draft in one forward."


def convert_gguf(file: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Path:
    """Write the Hugging Face folder of a GGUF file to ``out_dir`` (a new folder, written beside and
    renamed into place, so an interrupted conversion leaves nothing half-written) and check it: the
    saved model reloads with logits equal to the dequantised ones on a fixed text, and the tokenizer's
    special tokens match the file's metadata. Returns ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    file, out_dir = Path(file), Path(out_dir)
    if out_dir.exists():
        raise GGUFError(f"{out_dir} exists already: remove it to convert again")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    model = load_gguf_model(file, dtype=dtype)
    tokenizer = load_gguf_tokenizer(file)
    ids = torch.tensor([tokenizer(CHECK_TEXT)["input_ids"]])
    with torch.no_grad():
        reference = model(ids).logits
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = gguf_metadata(file)
        gen = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
        gen.save_pretrained(tmp)
        record = {"source": file.name, "sha256": sha256_file(file), "bytes": file.stat().st_size,
                  "dtype": str(dtype).removeprefix("torch."), "libraries": library_versions(),
                  "metadata": {k: v for k, v in meta.items() if k.startswith(("general.", "tokenizer.ggml."))}}
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
        with torch.no_grad():
            again = reloaded(ids).logits
        if not torch.equal(reference, again):
            raise GGUFError(f"the saved folder's logits differ from the GGUF model's (max "
                            f"{(reference - again).abs().max().item():.3g}): conversion is broken")
        tok2 = AutoTokenizer.from_pretrained(tmp)
        for role in ("bos", "eos"):
            key = f"tokenizer.ggml.{role}_token_id"
            if key in meta and getattr(tok2, f"{role}_token_id") != int(meta[key]):
                raise GGUFError(f"the saved tokenizer's {role} id {getattr(tok2, f'{role}_token_id')} differs from "
                                f"the file's {key}={meta[key]}")
        if tok2(CHECK_TEXT)["input_ids"] != ids[0].tolist():
            raise GGUFError("the saved tokenizer encodes the check text differently from the GGUF tokenizer")
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _local(name_or_path: str | os.PathLike) -> str:
    """``~/...`` paths expanded (configs name the converted reference folder that way); hub ids unchanged."""
    text = str(name_or_path)
    return os.path.expanduser(text) if text.startswith("~") else text


def is_gguf(name_or_path: str | os.PathLike, gguf_file: str | None = None) -> bool:
    return gguf_file is not None or str(name_or_path).endswith(".gguf")


def load_causal_lm(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                   gguf_file: str | None = None, **kwargs):
    """The one loader of target models: a ``.gguf`` file (or a folder with ``gguf_file=``) is
    dequantised here; anything else goes to ``AutoModelForCausalLM.from_pretrained``. Eval mode."""
    name_or_path = _local(name_or_path)
    if is_gguf(name_or_path, gguf_file):
        return load_gguf_model(name_or_path, gguf_file, dtype=dtype, **kwargs)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype, **kwargs).eval()


def load_tokenizer(name_or_path: str | os.PathLike, gguf_file: str | None = None):
    """The tokenizer that goes with :func:`load_causal_lm`'s model."""
    name_or_path = _local(name_or_path)
    if is_gguf(name_or_path, gguf_file):
        return load_gguf_tokenizer(name_or_path, gguf_file)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(name_or_path))
