"""--model checked before it loads (an extra: cli.check_common imports it for a --model other than the bundled default).
A local directory must hold a readable config.json, weights whose files are whole and agree with the config, and a
tokenizer; a hub id must be in the local cache or the hub reachable. Each problem is one line naming the directory or
file, exit code 2, at once rather than after minutes of retries.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from rlvr_utils.core.models import check_default, looks_like_path
from rlvr_utils.core.runtime import need, usage_error


def check_model(model: str) -> None:
    """A local directory must hold a model (config.json and weights); a hub id must be in the local cache or the hub
    reachable (one line at once, not minutes of retries)."""
    if looks_like_path(model):
        d = Path(model).expanduser()
        if d.parts[-2:] == ("assets", "tiny-arith"):  # the bundled model by another path (a copy, a clone)
            check_default(str(d))
        need(d.is_dir(), f"--model {model}: no such directory")
        cfg = d / "config.json"  # a FIFO, a device or a directory of that name: not "no config.json"
        what = "config.json is not a regular file" if cfg.exists() else "the directory holds no model (no config.json)"
        need(cfg.is_file(), f"--model {model}: {what}")
        weights = [*d.glob("*.safetensors"), *d.glob("*.bin"), *d.glob("*.safetensors.index.json")]
        need(bool(weights), f"--model {model}: the directory holds no weights (no *.safetensors or *.bin)")
        try:
            config = json.loads((d / "config.json").read_text())
        except (OSError, ValueError, RecursionError) as e:
            usage_error(f"--model {model}: config.json cannot be read as JSON ({type(e).__name__})")
        tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
        need(
            any((d / f).is_file() for f in tokenizer_files),
            f"--model {model}: the directory holds no tokenizer (none of {', '.join(tokenizer_files)}): copy the "
            "tokenizer files beside the weights (tokenizer.save_pretrained)",
        )
        for f in sorted(d.glob("*.safetensors")):
            check_safetensors(model, f, config.get("vocab_size") if isinstance(config, dict) else None)
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache(model, "config.json"), str)
    except Exception:  # an id the hub library rejects: from_pretrained will say why
        return
    if not cached:
        need_hub(
            f"--model {model} is a hub id, not a local directory, and it is not in the local cache",
            "a local directory (download it where there is internet: huggingface-cli download ...)",
        )


def check_safetensors(model: str, path: Path, vocab_size: int | None) -> None:
    """A .safetensors file whose header or data is cut short (an interrupted copy), or whose embedding rows disagree
    with config.json's vocab_size: one line naming the file, before anything loads."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
    except (OSError, ValueError):
        header = None
    need(isinstance(header, dict), f"--model {model}: {path.name} is damaged or truncated (its header cannot be read)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    end = max((v.get("data_offsets", [0, 0])[1] for v in tensors.values()), default=0)
    need(
        8 + n + end <= size,
        f"--model {model}: {path.name} is truncated ({size} bytes, its header describes {8 + n + end}): copy it again",
    )
    embed = next((v for k, v in tensors.items() if k.endswith("embed_tokens.weight") or k.endswith("wte.weight")), None)
    if vocab_size and embed and embed.get("shape"):
        need(
            embed["shape"][0] == vocab_size,
            f"--model {model}: config.json's vocab_size {vocab_size} does not match the weights' {embed['shape'][0]} "
            f"embedding rows ({path.name})",
        )


def need_hub(what: str, instead: str) -> None:
    """`what` needs the Hugging Face hub: fail at once when it is off (HF_HUB_OFFLINE) or cannot be reached."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if offline:
        usage_error(f"{what}, but HF_HUB_OFFLINE is set: pass {instead}")
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # reached through a proxy: no direct probe can tell; the download itself will say
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as e:
        usage_error(f"{what}, but the hub ({host}) cannot be reached ({type(e).__name__}): pass {instead}")
