"""llama.cpp's token ids for a corpus of strings, on Gemma 3's and SmolLM2's files, written as test fixtures.

`python -m bench.tokenizer_fixture` builds the corpus (hand-picked cases, then strings drawn with a
fixed seed from fragments in many scripts, emoji, code, whitespace, numbers and rare code points),
tokenizes each string with llama-cpp-python the way a completion prompt is tokenized
(`Llama(vocab_only=True).tokenize(text.encode(), add_bos=False, special=False)`: text that spells a
control token is text), a few of them again with add_bos=True, and writes
tests/fixtures/tokenizers/gemma3_tokenizer.json and smollm2_tokenizer.json with the file's SHA-256.
tests/workers/models/test_tokenizer_fixture.py holds our tokenizer to them; `make test` never needs
llama.cpp. Re-run this after changing the corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from bench.reference_fixtures import FIXTURES as FILE_FIXTURES
from bench.reference_fixtures import _quiet, engine
from workers.models import gemma3_path, smollm2_path

# Beside the forward fixtures, not among them: that directory holds one fixture per tiny model file.
FIXTURES = FILE_FIXTURES.parent / "tokenizers"

SEED = 20250302
GENERATED = 900  # strings drawn at random, after the hand-picked ones
SMOLLM2_DRAWN = 100  # SmolLM2's byte-level BPE gets the hand-picked cases and this many drawn ones
# Tokenized again with BOS, as a prompt starts: empty, spaces first, a marker first, plain prose.
WITH_BOS = [
    "", " ", "  leading", "\n", "<bos>", "<bos>Hello", "<start_of_turn>user", "Hello world",
    "Question: What is the capital of France?\nAnswer:", "日本語のテキストです。", "😀", "\tcode",
]  # fmt: skip

PROSE = {
    "latin": [
        "The quick brown fox jumps over the lazy dog.", "Café au lait, s'il vous plaît !",
        "naïve résumé façade coöperate", "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
        "¿Dónde está la biblioteca? ¡Aquí!", "Zażółć gęślą jaźń", "Příliš žluťoučký kůň úpěl ďábelské ódy",
        "Árvíztűrő tükörfúrógép", "Ça ira, ça ira", "Đây là tiếng Việt có dấu", "Ångström Øresund Æsir",
    ],
    "cyrillic": ["Привет, мир!", "Съешь же ещё этих мягких французских булок", "Україна — це Європа", "ЁЖИК"],
    "greek": ["Γειά σου Κόσμε", "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία", "ΑΒΓΔ αβγδ ά έ ή ΐ"],
    "arabic": ["مرحبا بالعالم", "اللغة العربية جميلة", "٠١٢٣٤٥٦٧٨٩", "كِتَابٌ"],
    "hebrew": ["שלום עולם", "עִבְרִית", "אבגד הוזח"],
    "devanagari": ["नमस्ते दुनिया", "हिन्दी भाषा", "क्षत्रिय ज्ञान", "०१२३"],
    "thai": ["สวัสดีชาวโลก", "ภาษาไทยง่ายนิดเดียว", "กรุงเทพมหานคร"],
    "cjk": ["你好，世界！", "日本語のテキストです。", "東京都渋谷区", "繁體中文測試", "カタカナ ひらがな",
            "漢字", "𠀀𠀁𪚥"],
    "korean": ["안녕하세요 세계", "한국어 문장입니다.", "ㄱㄴㄷ ㅏㅑㅓ"],
    "other": ["Բարեւ աշխարհ", "გამარჯობა", "ሰላም ልዑል", "ᚠᚢᚦᚨᚱᚲ", "ꦲꦤꦕꦫꦏ", "தமிழ் மொழி", "বাংলা ভাষা"],
}  # fmt: skip
EMOJI = [
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵🇺🇸", "❤️", "🧑🏿‍🚀", "🤷‍♀️", "👩‍❤️‍💋‍👨",
    "🫠", "🦄", "1️⃣", "#️⃣", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "☺︎", "✌🏻",
]  # fmt: skip
CODE = [
    "def f(x):\n    return {'a': x**2}  # ok\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
    "const add = (a, b) => a + b;\nconsole.log(add(1, 2));",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "#include <stdio.h>\nint main(void) { printf(\"hi\\n\"); }",
    "<div class=\"x\"><b>bold</b> <td>cell</td></div>",
    "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"ok\") }\n",
    "$ ls -la | grep '^d' && echo \"$HOME\"",
    "x = [i ** 2 for i in range(10) if i % 2 == 0]",
    "{\"key\": [1, 2.5, null, true], \"nested\": {\"a\": \"b\"}}",
    "public static void main(String[] args) throws Exception {}",
    "\\begin{equation} e^{i\\pi} + 1 = 0 \\end{equation}",
    "  - name: build\n    run: make test\n",
    "a := b &^ c; d <<= 2; e != f || g == h",
]  # fmt: skip
SPECIAL_LOOKING = [
    "<start_of_turn>", "<end_of_turn>", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<unused0>", "<unused99>", "<unused6241>", "[multimodal]",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>", "[multimodal", "multimodal]", "<start_of",
    "start_of_turn>", "<bos", "bos>", "< bos >", "<BOS>", "<<bos>>", "<bos><eos>", "text<eos>text",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "<|im_start|", "</s>", "<s>", "<0x41>", "<0xZZ>",
    "<table><tr><td>1</td></tr></table>", "<h1>Title</h1>", "<code>x</code>", "<s>strike</s>", "<<td>>",
]  # fmt: skip
WHITESPACE = [
    "", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", "\n\n\n\n", " \n", "\n ", " \t \n ", "\t\t\t",
    "  leading", "trailing  ", "  both  ", "\tTab\tseparated\t", "line one\nline two\n", "a\n\n\nb",
    "x" + " " * 40 + "y", "\n" * 35, " " * 33, "\t" * 32, "mixed \t\n \t\n", "\r", "a\rb", "\u3000full width",
    "\u00a0nbsp\u00a0", "word\u2028sep\u2029para", "\v\f", "   \n   \n", "end with newline\n", "\n start",
]  # fmt: skip
NUMBERS = [
    "0", "7", "42", "123456789012345678901234567890", "3.14159", "-0.5e-10", "1,000,000", "1 000 000",
    "2025-03-02", "12:34:56", "$19.99", "€5", "50%", "0xDEADBEEF", "1e100", "½ ¾ ⅓", "Ⅻ", "①②③",
    "١٢٣", "一二三", "+1 (555) 123-4567", "v1.2.3-rc.4",
]  # fmt: skip
URLS = [
    "https://example.com", "http://www.example.org/path/to/page.html?query=1&x=y#frag",
    "https://ja.wikipedia.org/wiki/日本", "mailto:someone@example.com", "ftp://files.example.net/a b.txt",
    "file:///home/user/.bashrc", "www.exa_mple.co.uk/~user", "user@host:~/repo.git",
]  # fmt: skip
ODD_UNICODE = [
    "\u0301", "\u0301\u0302\u0303", "e\u0301", "é", "\u0300abc", "a\u0308\u0304", "\u200b", "\u200d",
    "\ufeff", "\ufeffBOM", "\ufffd", "\uffff", "\ufffe", "\ue000", "\U000f0000", "\U0010ffff", "\U0001d54f",
    "\U0001f9ff", "\x00", "a\x00b", "\x01\x02\x1f", "\x7f", "\u0085", "\u202e reversed",
    "\u2066isolate\u2069",
    "ﬁ ﬂ", "Ａ Ｂ Ｃ", "ℌ𝔢𝔩𝔩𝔬", "ß ẞ", "İı", "ǅ", "\U00013000", "\U0001f600\U0001f600\U0001f600",
]  # fmt: skip
LONG = [
    "a" * 100, "ab" * 60, "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "Donaudampfschifffahrtselektrizitätenhauptbetriebswerkbauunterbeamtengesellschaft",
    "supercalifragilisticexpialidocious" * 3, "антидисэстаблишментарианизм", "x" * 300,
    "".join(chr(0x4E00 + i) for i in range(80)), "😀" * 50, "-" * 80, "=" * 64, "." * 50, "_" * 40,
]  # fmt: skip


def hand_picked() -> list[str]:
    """The cases chosen by hand: each group above, prose also with a space before it and a newline after."""
    prose = [s for group in PROSE.values() for s in group]
    spaced = [f" {s}" for s in prose] + [f"{s}\n" for s in prose[::3]]
    return [
        *WHITESPACE, *SPECIAL_LOOKING, *prose, *spaced, *EMOJI, *CODE, *NUMBERS, *URLS, *ODD_UNICODE, *LONG,
        "Question: What is the capital of France?\nAnswer:", "Hello world", "hello world", "HELLO WORLD",
    ]  # fmt: skip


def _random_code_point(rng: random.Random) -> str:
    """One code point from a block a tokenizer rarely sees (no surrogates: they are not UTF-8)."""
    start, end = rng.choice([
        (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x52F), (0x590, 0x6FF),
        (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x2BFF), (0x3040, 0x30FF),
        (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0xFE00, 0xFE0F), (0x1F300, 0x1FAFF),
        (0x20000, 0x2A6DF), (0xE0000, 0xE007F), (0x10000, 0x1FFFF),
    ])  # fmt: skip
    return chr(rng.randint(start, end))


def _fragment(rng: random.Random) -> str:
    """One piece of a drawn string: prose, emoji, code, a number, whitespace, a marker or a rare character."""
    kinds = ["prose", "prose", "prose", "emoji", "code", "number", "space", "special", "odd", "word"]
    kind = rng.choice(kinds)
    if kind == "prose":
        words = rng.choice(list(PROSE.values()))
        text = rng.choice(words)
        cut = text.split(" ")
        start = rng.randrange(len(cut))
        return " ".join(cut[start : start + rng.randint(1, 4)])
    if kind == "emoji":
        return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3)))
    if kind == "code":
        code = rng.choice(CODE)
        start = rng.randrange(len(code))
        return code[start : start + rng.randint(3, 30)]
    if kind == "number":
        whole = str(rng.randint(0, 10 ** rng.randint(1, 12)))
        return rng.choice([whole, f"{rng.uniform(-1e3, 1e3):.{rng.randint(0, 6)}f}"])
    if kind == "space":
        return "".join(rng.choice(" \t\n") for _ in range(rng.randint(1, 6)))
    if kind == "special":
        return rng.choice(SPECIAL_LOOKING)
    if kind == "odd":
        return "".join(_random_code_point(rng) for _ in range(rng.randint(1, 4)))
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return "".join(rng.choice(letters) for _ in range(rng.randint(1, 20)))


def drawn(n: int = GENERATED, seed: int = SEED) -> list[str]:
    """`n` strings of one to eight fragments, joined by a space, nothing or a newline; the same each run."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [_fragment(rng) for _ in range(rng.randint(1, 8))]
        out.append("".join(p + rng.choice([" ", " ", "", "\n"]) for p in parts)[: rng.choice([-1, None])])
    return out


def corpus() -> list[str]:
    """The hand-picked cases then the drawn ones, each once, in order."""
    return list(dict.fromkeys([*hand_picked(), *drawn()]))


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenize(path: Path, texts: list[str], with_bos: list[str]) -> dict:
    """llama.cpp's ids for each text as a completion prompt is tokenized, and with BOS for `with_bos`."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    plain = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts]
    bos = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in with_bos]
    llm.close()
    return {
        "file": path.name,
        "sha256": sha256(path),
        "engine": {k: v for k, v in engine().items() if k in ("llama_cpp_python", "ggml", "ggml_commit")},
        "how": "Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=False)",
        "cases": [[t, ids] for t, ids in zip(texts, plain, strict=True)],
        "with_bos": [[t, ids] for t, ids in zip(with_bos, bos, strict=True)],
    }


def dump(fix: dict) -> str:
    """The fixture as compact JSON, one case a line so that a change to the corpus reads as a diff."""
    head = {k: v for k, v in fix.items() if k not in ("cases", "with_bos")}
    lines = [f"{json.dumps(k)}:{json.dumps(v, ensure_ascii=False)}" for k, v in head.items()]
    for key in ("cases", "with_bos"):
        rows = ",\n".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) for row in fix[key])
        lines.append(f"{json.dumps(key)}:[\n{rows}\n]")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tokenizer_fixture", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=FIXTURES, help="where the fixtures go")
    args = parser.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise SystemExit("llama-cpp-python is not installed: pip install -e '.[bench]'") from exc
    _quiet()
    texts = corpus()
    fewer = list(dict.fromkeys([*hand_picked(), *drawn()[:SMOLLM2_DRAWN]]))
    for name, path, strings in (("gemma3", gemma3_path(), texts), ("smollm2", smollm2_path(), fewer)):
        fix = tokenize(path, strings, WITH_BOS)
        out = args.out / f"{name}_tokenizer.json"
        out.write_text(dump(fix))
        print(f"{out}: {len(strings)} strings, {out.stat().st_size // 1024} KB", flush=True)


if __name__ == "__main__":
    main()
