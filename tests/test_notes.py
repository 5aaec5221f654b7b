"""Notes resolve: every ``Note [X]`` title is defined once, and every pointer names a defined one.

A Note is dpfx's titled rationale (GHC's convention, which PyTorch's sources use too). A line
that holds nothing but the title defines it, in a comment or a docstring::

    # Note [Noise added in place]
    # The release is one call of dpfx::add_noise_ ...

Every other mention points at it, and may wrap over lines: ``See Note [Noise added in place]``,
``(Note [Noise added in place] in ops/noise.py)``. Read from dpfx/ and tests/ (Python and C
sources) and from the packages' READMEs and docs/ (pointers only).
"""
import bisect
import os
import re
from collections import defaultdict

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
SOURCES = (".py", ".c", ".h")
DEFINITION = re.compile(r"^\s*(?:#|\*|//)?\s*Note \[([^\]]+)\]\s*$")
MENTION = re.compile(r"Note\s+\[([^\]]+)\]")
# a line's comment markers, dropped so that a title wrapped over comment lines reads as one
MARKER = re.compile(r"^\s*(?:#|\*|//|/\*)?\s?")
JOINED = re.compile(r"""["']\s+[fFrRbB]{0,2}["']""")


def title(text: str) -> str:
    """The title with its whitespace collapsed, across adjacent string literals too (a message
    that wraps a title: ``"... (Note [One release per " "forward] ...)"``)."""
    return " ".join(JOINED.sub(" ", text).split())


def files(top: str, endings: tuple[str, ...]) -> list[str]:
    found = []
    for dirpath, _, names in os.walk(os.path.join(REPO, top)):
        found += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith(endings)]
    return sorted(found)


def notes(path: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(definitions, pointers) of one file, each as (title, line)."""
    lines = open(path, encoding="utf-8").read().splitlines()
    definitions, heads = [], set()
    if path.endswith(SOURCES):
        for number, line in enumerate(lines, 1):
            m = DEFINITION.match(line)
            if m:
                definitions.append((title(m.group(1)), number))
                heads.add(number)
    # the text with each line's comment marker dropped, so a wrapped title is one string
    text, starts = "", []
    for line in lines:
        starts.append(len(text))
        text += MARKER.sub("", line, count=1) + "\n"
    pointers = []
    for m in MENTION.finditer(text):
        number = bisect.bisect_right(starts, m.start())
        if number not in heads:
            pointers.append((title(m.group(1)), number))
    return definitions, pointers


def scan(paths: list[str]) -> tuple[dict, dict]:
    defined, pointed = defaultdict(list), defaultdict(list)
    for path in paths:
        definitions, pointers = notes(path)
        where = os.path.relpath(path, REPO)
        for name, line in definitions:
            defined[name].append(f"{where}:{line}")
        for name, line in pointers:
            pointed[name].append(f"{where}:{line}")
    return defined, pointed


def problems(paths: list[str]) -> list[str]:
    defined, pointed = scan(paths)
    found = [f"Note [{name}] is defined {len(at)} times: {', '.join(at)}"
             for name, at in sorted(defined.items()) if len(at) > 1]
    found += [f"Note [{name}] is pointed at and never defined: {', '.join(at)}"
              for name, at in sorted(pointed.items()) if name not in defined]
    return found


def project() -> list[str]:
    """dpfx's sources, the tests (which point at dpfx's Notes and keep a few of their own), the
    guides and the benchmarks; this file's planted titles are not Notes."""
    tests = [p for p in files("tests", SOURCES) if os.path.abspath(p) != os.path.abspath(__file__)]
    return (files("dpfx", SOURCES + (".md",)) + tests + files("docs", (".md",))
            + files("benchmarks", SOURCES + (".md",)))


def test_every_note_is_defined_once_and_every_pointer_resolves():
    paths = project()
    defined, _ = scan(paths)
    assert len(defined) > 100, "the scan found almost no Notes: has their form changed?"
    found = problems(paths)
    assert not found, "\n".join(found)


def test_the_check_finds_a_second_definition_and_a_dangling_pointer(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("# Note [Why the clip comes first]\n# The norm needs every gradient.\n"
                 "x = 1  # See Note [Why the noise\n#   comes last]\n")
    b.write_text('"""Docs.\n\nNote [Why the clip comes first]\nAgain.\n"""\n'
                 "# (Note [Why the clip comes first] in a.py) resolves\n")
    defined, pointed = scan([str(a), str(b)])
    assert sorted(defined) == ["Why the clip comes first"]
    assert len(defined["Why the clip comes first"]) == 2
    assert sorted(pointed) == ["Why the clip comes first", "Why the noise comes last"]
    found = problems([str(a), str(b)])
    assert len(found) == 2
    assert "defined 2 times" in found[0] and "never defined" in found[1]
    b.write_text("# (Note [Why the clip comes first] in a.py) resolves\n")
    a.write_text("# Note [Why the clip comes first]\n# Note [Why the noise comes last]\n")
    assert problems([str(a), str(b)]) == []
