"""Tiny models built locally (no model hub) and the vLLM engine settings that the e2e tests and
the engine benchmarks share.

Builds are deterministic: the same arguments give the same files. Each build lands in a
subdirectory of a cache root named after its parameters and is reused when present.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

MiB = 1 << 20

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
VOCAB_SIZE = 2000
MAX_POSITIONS = 8192

MAX_MODEL_LEN = 4096
BLOCK_SIZE = 32
KV_CACHE_BYTES = 256 * MiB

_DONE = ".complete"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

_ONSETS = ("b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ea", "ou", "ai")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "ng", "st")
_COMMON = (
    "the", "a", "of", "and", "to", "in", "is", "was", "that", "for", "it", "with", "as", "on",
    "by", "at", "from", "this", "which", "or", "be", "are", "an", "not", "but", "had", "they",
)  # fmt: skip


@dataclass(frozen=True)
class ModelSet:
    tokenizer: Path
    target: Path
    draft: Path
    benchmark: Path | None = None


def _is_built(path: Path) -> bool:
    return (path / _DONE).is_file()


def _fresh(path: Path) -> None:
    # A build that died halfway leaves files without the marker; start over.
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _start_build(root: Path, path: Path, tokenizer_dir: Path | None) -> tuple[Path, Any]:
    """The tokenizer a model is built with (the one under ``root`` when none is given), and
    ``path`` emptied for the build."""
    from transformers import PreTrainedTokenizerFast

    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else build_tokenizer(root)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    _fresh(path)
    return tokenizer_dir, tokenizer


def _save(model: Any, path: Path, tokenizer_dir: Path) -> Path:
    """Weights as safetensors, the tokenizer beside them, then the marker of a whole build."""
    model.save_pretrained(str(path), safe_serialization=True)
    for file in _TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy2(tokenizer_dir / file, path / file)
    (path / _DONE).touch()
    return path


def _word(rng: random.Random) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.choice((1, 1, 2, 2, 3)))
    )


def english_like_text(
    num_sentences: int = 4000, *, seed: int = 0, lexicon_size: int = 1500
) -> list[str]:
    """Sentences of invented words with a Zipf-like frequency, plus common English words."""
    rng = random.Random(seed)
    lexicon = sorted({_word(rng) for _ in range(lexicon_size)})
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    sentences = []
    for _ in range(num_sentences):
        words = []
        for _ in range(rng.randint(6, 18)):
            if rng.random() < 0.35:
                words.append(rng.choice(_COMMON))
            else:
                words.append(rng.choices(lexicon, weights)[0])
        words[0] = words[0].capitalize()
        sentences.append(" ".join(words) + rng.choice((".", ".", ".", "?", "!")))
    return sentences


def build_tokenizer(root: Path, *, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer saved as a transformers PreTrainedTokenizerFast."""
    path = Path(root) / f"tokenizer-v{vocab_size}-s{seed}"
    if _is_built(path):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    _fresh(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
            ),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(english_like_text(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(str(path))
    (path / _DONE).touch()
    return path


def build_llama(
    root: Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    tokenizer_dir: Path | None = None,
    name: str | None = None,
) -> Path:
    """A random-weight LlamaForCausalLM with the tokenizer beside it, loadable by `LLM(model=)`."""
    intermediate = intermediate or 2 * hidden
    name = name or (
        f"llama-l{layers}-h{hidden}-a{heads}-kv{kv_heads}-d{head_dim}-i{intermediate}"
        f"-{dtype}-s{seed}"
    )
    path = Path(root) / name
    if _is_built(path):
        return path
    tokenizer_dir, tokenizer = _start_build(root, path, tokenizer_dir)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    return _save(model, path, tokenizer_dir)


def build_draft(root: Path, **kwargs: Any) -> Path:
    """The target's build with a single layer."""
    return build_llama(root, **{**kwargs, "layers": 1})


@dataclass(frozen=True)
class EagleModels:
    target: Path
    head: Path


def build_eagle_pair(
    root: Path,
    *,
    tokenizer_dir: Path | None = None,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
) -> EagleModels:
    """A 2-layer fp32 target and an EAGLE head (one layer, numbered after the target's) that
    reproduces the target's first layer.

    A random head never agrees with its target, so acceptance would tell nothing. Here the
    target's embeddings have unit RMS, so the head's missing input norm changes nothing; its
    first layer attends sharply and strongly, so the head's proposals depend on the head's own
    KV cache; its second layer only nudges the result. The head is that first layer behind an
    ``fc`` that passes the token embedding through, sharing the target's embeddings and
    lm_head. It proposes what the target says, and nonsense once its KV pages are lost.
    """
    suffix = f"h{hidden}-a{heads}-kv{kv_heads}-d{head_dim}-s{seed}"
    target_path = Path(root) / f"eagle-target-{suffix}"
    head_path = Path(root) / f"eagle-head-{suffix}"
    if _is_built(target_path) and _is_built(head_path):
        return EagleModels(target_path, head_path)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else build_tokenizer(root)
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
        first = model.model.layers[0].self_attn
        for proj, scale in ((first.q_proj, 8.0), (first.k_proj, 8.0)):
            proj.weight.mul_(scale)  # sharp attention: a few positions decide
        for proj in (first.v_proj, first.o_proj):
            proj.weight.mul_(4.5)  # attention output about as large as the embedding
        second = model.model.layers[1]
        second.self_attn.o_proj.weight.mul_(0.1)
        second.mlp.down_proj.weight.mul_(0.1)
    _fresh(target_path)
    model.save_pretrained(str(target_path), safe_serialization=True)
    for file in _TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy2(tokenizer_dir / file, target_path / file)
    (target_path / _DONE).touch()

    _fresh(head_path)
    head_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
    head_config.architectures = ["LlamaForCausalLM"]  # vLLM loads it as EagleLlamaForCausalLM
    head_config.save_pretrained(str(head_path))
    # EAGLE checkpoints name weights without "model."; no lm_head, final norm or input norm
    layer = "model.layers.0."
    weights = {
        name.removeprefix("model."): tensor.detach().clone().contiguous()
        for name, tensor in model.state_dict().items()
        if name.startswith(layer) and "input_layernorm" not in name
    }
    weights["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    save_file(weights, str(head_path / "model.safetensors"), metadata={"format": "pt"})
    (head_path / _DONE).touch()
    return EagleModels(target_path, head_path)


_GEMMA3_LAYER_TYPES = {"S": "sliding_attention", "F": "full_attention"}


def build_gemma3_hybrid(
    root: Path,
    *,
    layer_types: Sequence[str] = ("S", "F", "S", "F"),
    sliding_window: int = 200,
    hidden_size: int = 256,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    name: str | None = None,
) -> Path:
    """A random-weight fp32 Gemma3ForCausalLM (model_type gemma3_text) with the tokenizer
    beside it: "S" layers use a sliding window of `sliding_window` tokens, "F" layers attend
    fully. With a connector that supports HMA, vLLM gives the two kinds separate KV groups.

    Head dim 32 (4 query heads, 2 KV heads) keeps it on the CPU attention backend's sizes.
    """
    kinds = tuple(layer_types)
    unknown = sorted(set(kinds) - set(_GEMMA3_LAYER_TYPES))
    if not kinds or unknown:
        raise ValueError(f"layer_types must be a non-empty sequence of 'S'/'F', got {kinds!r}")
    name = name or (
        f"gemma3-{''.join(kinds)}-w{sliding_window}-h{hidden_size}-a4-kv2-d32-float32-s{seed}"
    )
    path = Path(root) / name
    if _is_built(path):
        return path
    tokenizer_dir, tokenizer = _start_build(root, path, tokenizer_dir)
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    head_dim = 32
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=len(kinds),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=sliding_window,
        layer_types=[_GEMMA3_LAYER_TYPES[k] for k in kinds],
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        dtype="float32",
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)  # fp32: torch's default dtype
    return _save(model, path, tokenizer_dir)


def build_benchmark_llama(root: Path, *, tokenizer_dir: Path | None = None) -> Path:
    return build_llama(
        root,
        layers=12,
        hidden=768,
        heads=8,
        kv_heads=4,
        head_dim=64,
        intermediate=2048,
        dtype="bfloat16",
        tokenizer_dir=tokenizer_dir,
    )


def build_models(root: Path, *, benchmark: bool = False) -> ModelSet:
    tokenizer = build_tokenizer(root)
    return ModelSet(
        tokenizer=tokenizer,
        target=build_llama(root, tokenizer_dir=tokenizer),
        draft=build_draft(root, tokenizer_dir=tokenizer),
        benchmark=build_benchmark_llama(root, tokenizer_dir=tokenizer) if benchmark else None,
    )


def vocab_size_of(model_path: Path) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config["vocab_size"])


def kv_bytes_per_token(model_path: Path, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token (2 bytes: bf16)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    return int(layers * kv_heads * head_dim * 2 * dtype_bytes)


def shared_prefix_prompts(
    num_prompts: int,
    *,
    vocab_size: int = VOCAB_SIZE,
    prefix_len: int = 800,
    suffix_len: int = 64,
    num_prefixes: int = 1,
    seed: int = 0,
) -> list[list[int]]:
    """Token-id prompts: `num_prefixes` long prefixes shared round-robin, distinct suffixes."""
    rng = random.Random(seed)
    low = len(SPECIAL_TOKENS)
    prefixes = [
        [rng.randrange(low, vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)
    ]
    return [
        prefixes[i % num_prefixes] + [rng.randrange(low, vocab_size) for _ in range(suffix_len)]
        for i in range(num_prompts)
    ]


def capture_config(layers: Sequence[int]) -> dict[str, Any]:
    """A ``speculative_config`` capturing the target's hidden states at ``layers``."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}},
    }


def engine_env(
    tmp: Path, *, multiprocess: bool = False, caches: Path | None = None
) -> dict[str, str]:
    """Environment for one engine: offline, with sockets and temp files in new dirs under `tmp`,
    and vLLM's and torch's caches under ``caches`` (default `tmp`). What they cache is compiled
    kernels, keyed by their source: engines may share them, and a fresh cache costs a TP=2
    engine about 15 s of compiling."""
    tmp = Path(tmp)
    caches = tmp if caches is None else Path(caches)
    dirs = {
        "VLLM_CACHE_ROOT": caches / "vllm-cache",
        "TORCHINDUCTOR_CACHE_DIR": caches / "inductor",
        "TMPDIR": tmp / "tmp",
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    if caches != tmp:
        # torch keeps its precompiled headers under the temp dir, whatever its cache dir says
        headers = caches / "inductor-tmp"
        headers.mkdir(exist_ok=True)
        link = dirs["TMPDIR"] / f"torchinductor_{getpass.getuser()}"
        if not link.exists():
            link.symlink_to(headers, target_is_directory=True)
    return {
        **{k: str(v) for k, v in dirs.items()},
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def apply_engine_env(env: Mapping[str, str]) -> None:
    """Set `env` in os.environ for good (scripts; tests use monkeypatch instead)."""
    os.environ.update(env)
    # The KV size comes from kv_cache_memory_bytes; this variable would silently override it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    reset_env_caches()


def reset_env_caches() -> None:
    """Make tempfile and vLLM read the environment again: both cache it after first use."""
    tempfile.tempdir = None
    envs = sys.modules.get("vllm.envs")
    if envs is not None:
        envs.disable_envs_cache()


def make_llm(
    model_path: Path,
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    multiprocess: bool = False,
    kv_events: bool = False,
    **kwargs: Any,
) -> Any:
    """A small eager vllm.LLM with a fixed KV size; `kwargs` override any engine argument.
    ``kv_events``: vLLM's KV events on, published nowhere (the connector makes events only
    when vLLM publishes them).

    Apply `engine_env` first (through monkeypatch in tests). The multiprocessing switch is set
    here because vLLM reads it while it builds the engine.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    reset_env_caches()
    from vllm import LLM

    settings: dict[str, Any] = {
        "model": str(model_path),
        "enforce_eager": True,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "block_size": BLOCK_SIZE,
        "dtype": "float32",
        "disable_log_stats": False,
        "seed": 0,
    }
    if kv_transfer_config is not None:
        settings["kv_transfer_config"] = dict(kv_transfer_config)
    if kv_events:
        from vllm.config import KVEventsConfig

        settings["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    settings.update(kwargs)
    return LLM(**settings)


def shutdown_llm(llm: Any) -> None:
    """Stop the engine core (in-process or its child process) and release its tensors."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is None:
        return
    pids = spawned_children()
    core.shutdown()
    # vLLM gives an engine process 5 s to exit, then SIGKILLs it and returns at once: what the
    # process held (an arena's lock) is free only once it has exited
    wait_exited(pids)
    # The multiprocess client never closes its zmq context; left to the GC it warns
    # (ResourceWarning) at some later, unrelated point. Its output thread closes its own
    # socket once told to stop, so wait for that before destroying the context.
    thread = getattr(core, "output_queue_thread", None)
    if thread is not None:
        thread.join(timeout=10)
    ctx = getattr(core, "ctx", None)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)


def spawned_children() -> list[int]:
    """Pids of the processes this one started through multiprocessing (an engine's core or
    workers) and of their descendants; not the resource tracker or other programs."""
    found = []
    for child in multiprocessing.active_children():
        with contextlib.suppress(psutil.Error):  # gone already
            descendants = psutil.Process(child.pid).children(recursive=True)
            found += [child.pid, *(d.pid for d in descendants)]
    return found


def wait_exited(pids: list[int], timeout_s: float = 30.0) -> None:
    """Until each process has exited or ``timeout_s`` passed; never reaps one, which is its
    parent's to do. A killed process's main thread may be a zombie while its other threads
    still hold its files: exited is gone, or a zombie with no thread left beside it."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline and not _exited(pid):
            time.sleep(0.02)


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        return state in "ZX" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except (FileNotFoundError, ProcessLookupError):
        return True


@contextmanager
def running_llm(model_path: Path, **kwargs: Any) -> Iterator[Any]:
    """`make_llm(model_path, **kwargs)`, shut down on exit so the next engine can start.

    The KV cache and weights are released on exit even while the caller still holds the LLM:
    vLLM's shutdown unfreezes the GC heap it froze at start-up and collects it.
    """
    llm = make_llm(model_path, **kwargs)
    try:
        yield llm
    finally:
        shutdown_llm(llm)


def greedy(max_tokens: int = 16) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate_tokens(
    llm: Any, prompts: Sequence[Sequence[int]], *, max_tokens: int = 16
) -> tuple[list[list[int]], list[int]]:
    """Greedy completions and `num_cached_tokens` per prompt, in prompt order."""
    outputs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts], greedy(max_tokens), use_tqdm=False
    )
    return (
        [list(out.outputs[0].token_ids) for out in outputs],
        [out.num_cached_tokens or 0 for out in outputs],
    )


def counter_value(llm: Any, name: str) -> int:
    """Sum of a vLLM Prometheus counter over this engine's label sets."""
    return int(counter(llm, name))


def counter(llm: Any, name: str, **labels: str) -> float:
    """A vLLM counter summed over the series whose labels include ``labels``."""
    from vllm.v1.metrics.reader import Counter

    return sum(
        m.value
        for m in llm.get_metrics()
        if isinstance(m, Counter)
        and m.name == name
        and all(m.labels.get(k) == v for k, v in labels.items())
    )
