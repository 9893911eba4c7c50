"""llama.cpp's answers for every tiny architecture file, written as test fixtures (tests/fixtures/llamacpp).

`python -m bench.reference_fixtures` writes each tiny file (tests/support/tiny_gguf.py: every
architecture of TINY_ARCHS in every type of TYPES, the K types on the wider TINY_K_ARCHS) into
a temporary directory, loads it with llama-cpp-python, evaluates a prompt of token ids (ids,
never text, so both sides see exactly the same input; no BOS is added), then takes STEPS greedy
tokens, and writes one JSON file per
tiny file: its sha256, the prompt, the last position's logits, the greedy tokens, each step's
lead of the top logit over the second, and which llama.cpp computed them.
tests/workers/models/test_llamacpp_fixtures.py holds our forward to them; `make test` never
needs llama.cpp. Re-run this after changing the writer (the tests compare the sha256).

llama.cpp runs on one thread (its sums then do not depend on how work is split), with its
KV cache in float32 and flash attention off: its default float16 cache would round every key
and value, which our stages keep in float32, and hide a disagreement of the math under that
rounding. Logits are kept to DECIMALS decimals: llama.cpp's float32 answers on f32 files agree
with ours to ~1e-5, so 4 decimals lose nothing a test can use, and a fixture stays ~3 KB.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np

from tests.support.tiny_gguf import K_TYPES, TINY_ARCHS, TINY_K_ARCHS, tiny_arch, tiny_names, write_tiny_arch

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llamacpp"
# The stored types with fixtures. A type joins here once tiny_gguf writes it (QTYPES, K_TYPES: the
# K types on the wider TINY_K_ARCHS); then run `python -m bench.reference_fixtures --only <type>`
# and commit what it writes.
TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", *K_TYPES)
THREADS = 1
CONTEXT = 64  # the tiny files' context length: the prompt and every greedy step fit
STEPS = 8
DECIMALS = 4
F32_CACHE = 0  # GGML_TYPE_F32, for llama.cpp's keys and values
# Token ids of the 263-token vocabulary (bytes 0-255, then merges "Ġt" 256, "he" 257, "Ġthe" 258,
# "is" 259, "Ġa" 260): a few bytes and merged tokens, longer than gemma3's window of 4.
PROMPT = [104, 46, 210, 222, 138, 70, 65, 118, 206, 105]
# The sliding window's own fixtures, in WINDOW_DIR: gemma3's tiny files (window 4) on a prompt of
# ten windows, its greedy steps then wrapping the windowed layers' rings twice more. The test feeds
# the prompt in chunks that start inside a held window and outgrow it; llama.cpp takes it whole.
WINDOW_DIR = FIXTURES / "window"
WINDOW_FILES = (("gemma3", "f32"), ("gemma3", "q8_0"), ("gemma3_k", "q4_k_m"))
WINDOW_PROMPT = [
    191, 248, 231, 134, 247, 256, 255, 21, 119, 159, 74, 99, 164, 210, 152, 45, 177, 229, 57, 143,
    88, 237, 15, 125, 236, 113, 36, 207, 253, 258, 244, 97, 192, 254, 150, 244, 155, 46, 122, 160,
]  # fmt: skip


def fixture_path(name: str, qtype: str, directory: Path = FIXTURES) -> Path:
    """Where the fixture of tiny file `<name>-<qtype>` is kept."""
    return directory / f"{name}-{qtype}.json"


def _quiet() -> None:
    """Send llama.cpp's log lines nowhere: its warnings about a tiny context are not ours to read."""
    import llama_cpp

    @llama_cpp.llama_log_callback
    def ignore(level, text, user_data):
        return None

    _quiet.callback = ignore  # kept alive as long as llama.cpp may call it
    llama_cpp.llama_log_set(ignore, ctypes.c_void_p())


def engine() -> dict:
    """Which llama.cpp computes: the binding's version, ggml's version and commit, and its settings."""
    import llama_cpp

    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_version.restype = ggml.ggml_commit.restype = ctypes.c_char_p
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "ggml": ggml.ggml_version().decode(),
        "ggml_commit": ggml.ggml_commit().decode(),
        "threads": THREADS,
        "n_ctx": CONTEXT,
        "kv_cache": "f32",
        "flash_attn": False,
    }


def _load(path: Path):
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_ctx=CONTEXT,
        n_batch=CONTEXT,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        type_k=F32_CACHE,
        type_v=F32_CACHE,
        flash_attn=False,
        verbose=False,
    )


def _last_logits(llm) -> np.ndarray:
    """The logits of the last token evaluated (llama.cpp computes only that row), copied."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()


def answers(path: Path, prompt: list[int], steps: int = STEPS) -> dict:
    """llama.cpp's last-position logits on `prompt`, then `steps` greedy tokens and each one's lead."""
    llm = _load(path)
    llm.eval(prompt)
    logits = _last_logits(llm)
    first, tokens, gaps = logits, [], []
    for step in range(steps):
        if step:
            llm.eval([tokens[-1]])
            logits = _last_logits(llm)
        top, second = np.sort(logits)[-2:][::-1]
        tokens.append(int(np.argmax(logits)))
        gaps.append(round(float(top - second), DECIMALS))
    llm.close()
    return {
        "last_logits": [round(float(v), DECIMALS) for v in first],
        "greedy": tokens,
        "gaps": gaps,
    }


def fixture(name: str, qtype: str, directory: Path, about: dict, prompt: list[int] = PROMPT) -> dict:
    """Write tiny file `<name>-<qtype>` into directory and return its fixture on `prompt`."""
    path = directory / f"{name}-{qtype}.gguf"
    write_tiny_arch(path, tiny_arch(name), qtype)
    table = "TINY_K_ARCHS" if name in TINY_K_ARCHS else "TINY_ARCHS"
    return {
        "file": path.name,
        "writer": f"tests.support.tiny_gguf.write_tiny_arch(path, {table}[{name!r}], {qtype!r})",
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "engine": about,
        "prompt": prompt,
        "logits_decimals": DECIMALS,
        **answers(path, prompt),
    }


def dump(fix: dict) -> str:
    """The fixture as JSON, one key a line (the logits on one line of their own)."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in fix.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reference_fixtures", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=FIXTURES, help="where the fixtures go")
    parser.add_argument(
        "--only",
        nargs="*",
        default=(),
        help="tiny names and / or types to write, or window for the window's (default: all of each)",
    )
    args = parser.parse_args()
    unknown = set(args.only) - set(TINY_ARCHS) - set(TINY_K_ARCHS) - set(TYPES) - {"window"}
    if unknown:
        parser.error(f"--only: not a tiny name or type: {', '.join(sorted(unknown))}")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise SystemExit("llama-cpp-python is not installed: pip install -e '.[bench]'") from exc
    _quiet()
    about = engine()
    types = [t for t in TYPES if t in args.only] or list(TYPES)
    files = [(n, q) for q in types for n in tiny_names(q)]
    if set(args.only) & (set(TINY_ARCHS) | set(TINY_K_ARCHS)):
        files = [(n, q) for n, q in files if n in args.only]
    jobs = [(n, q, args.out, PROMPT) for n, q in files if set(args.only) != {"window"}]
    if not args.only or "window" in args.only:
        jobs += [(n, q, args.out / WINDOW_DIR.name, WINDOW_PROMPT) for n, q in WINDOW_FILES]
    with tempfile.TemporaryDirectory() as tmp:
        for name, qtype, out, prompt in jobs:
            fix = fixture(name, qtype, Path(tmp), about, prompt)
            out.mkdir(parents=True, exist_ok=True)
            fixture_path(name, qtype, out).write_text(dump(fix))
            print(f"{out.name}/{name}-{qtype}: greedy {fix['greedy']} gaps {fix['gaps']}", flush=True)


if __name__ == "__main__":
    main()
