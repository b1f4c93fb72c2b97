"""The size rules of the C++ sources (issue 23), checked on every run so that they cannot regress in silence:

* no file under src/ or include/ is longer than 500 lines;
* no C++ function (at namespace or class scope, its signature included) is longer than 80 lines;
* ``getenv`` appears in exactly one file of src/ (the settings, read once: settings.cc).

Pure Python over the source tree: nothing is built or imported from layerstream. The function scanner is a
small brace matcher; its own tests below prove that it finds a long function and is not fooled by braces in
comments, strings, character literals, raw strings or macros.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
CXX_SUFFIXES = {".h", ".hh", ".hpp", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".inl"}


@dataclass
class Function:
    name: str
    first_line: int  # 1-based: where its signature starts
    last_line: int  # its closing brace

    @property
    def lines(self) -> int:
        return self.last_line - self.first_line + 1


_RAW_STRING = re.compile(r'R"([^ ()\\\t\n]{0,16})\(')


def strip_cxx(text: str) -> str:
    """`text` with comments, string and character literals and preprocessor lines blanked out (their
    characters turned into spaces, newlines kept), so that line numbers stay and only code braces remain."""
    out: list[str] = []
    i, n = 0, len(text)
    line_start = True  # only whitespace since the last newline: a '#' there starts a directive

    def blank(s: str) -> str:
        return "".join("\n" if c == "\n" else " " for c in s)

    while i < n:
        c = text[i]
        if c == "\n":
            out.append(c)
            line_start = True
            i += 1
            continue
        if line_start and c == "#":  # a directive, with its backslash continuations
            j = i
            while j < n and text[j] != "\n":
                if text[j] == "\\" and j + 1 < n and text[j + 1] == "\n":
                    j += 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(blank(text[i:j]))
            i = j
        elif c == "R" and (m := _RAW_STRING.match(text, i)) and not _in_identifier(text, i):
            end = text.find(")" + m.group(1) + '"', m.end())
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append('""' + blank(text[i + 2 : j]))  # keeps the token a string, its contents gone
            i = j
        elif c in "\"'":
            if c == "'" and _after_number(text, i):
                out.append(c)  # a digit separator (1'000'000), not a character literal
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + blank(text[i + 1 : j - 1]) + c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _in_identifier(text: str, i: int) -> bool:
    """Whether `i` continues an identifier (the R of fooR"x" is not a raw string's; of u8R"(x)" it is)."""
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] == "_"):
        j -= 1
    return text[j:i] not in ("", "u8", "u", "U", "L")


def _after_number(text: str, i: int) -> bool:
    """Whether the token that ends just before `i` is a number (not a literal's prefix such as u8 or L)."""
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] in "_'"):
        j -= 1
    return j < i and text[j].isdigit()


_ACCESS = re.compile(r"^\s*(?:(?:public|private|protected)\s*:(?!:)\s*)+")
_TEMPLATE = re.compile(r"^\s*template\s*<")


def _drop_template_prefix(head: str) -> str:
    """`head` without a leading template<...> (nested angle brackets matched)."""
    while m := _TEMPLATE.match(head):
        depth, j = 1, m.end()
        while j < len(head) and depth:
            depth += {"<": 1, ">": -1}.get(head[j], 0)
            j += 1
        head = head[j:]
    return head


def _kind(head: str) -> str:
    """What a '{' at namespace or class scope opens, from the code before it (since the last ; { or })."""
    h = _drop_template_prefix(_ACCESS.sub("", head)).strip()
    if re.match(r"^(inline\s+)?namespace\b", h) or re.match(r'^extern\s*""$', h):
        return "namespace"
    if re.match(r"^(typedef\s+)?(class|struct|union)\b", h) and "(" not in h.split(":", 1)[0]:
        return "class"
    if re.match(r"^(typedef\s+)?enum\b", h) or "(" not in h or h.endswith("=") or ("=" in h and ")" not in h):
        return "other"  # an enum, or an initializer (aggregate or brace-init of a variable)
    return "function"


def _name_of(head: str) -> str:
    h = _drop_template_prefix(_ACCESS.sub("", head))
    m = re.search(r"([~\w:]+(?:operator\s*\S+?)?)\s*\(", h)
    return m.group(1) if m else h.strip().split("\n")[0][:60] or "<body>"


def functions(text: str) -> list[Function]:
    """The function bodies at namespace or class scope of C++ source `text` (lambdas and local classes
    inside a function count as part of it)."""
    code = strip_cxx(text)
    found: list[Function] = []
    stack: list[str] = []  # kinds of the open braces: namespace, class, function, other
    head_start = 0  # where the code before the next brace starts
    fn_open: tuple[str, int] | None = None  # the function whose body is open: name, first line
    # The last function closed at this scope with nothing but a brace-init list since: a constructor's
    # `: a_{1}, b_{2} {` opened braces for its members before its body (an empty head, or one from a ',').
    init_list_fn: Function | None = None
    for i, c in enumerate(code):
        if c in ";{}" and (not stack or stack[-1] in ("namespace", "class")):
            head = code[head_start:i]
        if c == "{":
            if stack and stack[-1] not in ("namespace", "class"):
                stack.append("inner")
                continue
            kind = _kind(head)
            continued = init_list_fn is not None and (not head.strip() or head.strip().startswith(","))
            if continued:
                kind = "function"
            stack.append(kind)
            if continued:
                found.remove(init_list_fn)
                fn_open = (init_list_fn.name, init_list_fn.first_line)
            elif kind == "function":
                m = _ACCESS.match(head)
                base = m.end() if m else 0
                offset = base + len(head[base:]) - len(head[base:].lstrip())
                fn_open = (_name_of(head), code.count("\n", 0, head_start + offset) + 1)
            init_list_fn = None
            head_start = i + 1
        elif c == "}":
            if not stack:
                raise ValueError(f"unbalanced '}}' at line {code.count(chr(10), 0, i) + 1}")
            kind = stack.pop()
            if kind == "function" and fn_open is not None:
                found.append(Function(fn_open[0], fn_open[1], code.count("\n", 0, i) + 1))
                fn_open = None
                init_list_fn = found[-1]
            if not stack or stack[-1] in ("namespace", "class"):
                head_start = i + 1
        elif c == ";" and (not stack or stack[-1] in ("namespace", "class")):
            head_start = i + 1
            init_list_fn = None
    if stack:
        raise ValueError(f"{len(stack)} unclosed '{{'")
    return found


def _sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*") if p.is_file())


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


# --- the rules ------------------------------------------------------------------------------------------------


def test_no_source_file_over_500_lines():
    files = _sources("src", "include")
    assert files, f"no sources found under {ROOT}/src"
    long = {_rel(p): len(_read(p).splitlines()) for p in files}
    over = {k: v for k, v in long.items() if v > MAX_FILE_LINES}
    assert not over, f"files over {MAX_FILE_LINES} lines (split them by responsibility): {over}"


def test_no_function_over_80_lines():
    over = []
    scanned = 0
    for p in _sources("src", "include"):
        if p.suffix not in CXX_SUFFIXES:
            continue
        for f in functions(_read(p)):
            scanned += 1
            if f.lines > MAX_FUNCTION_LINES:
                over.append(f"{_rel(p)}:{f.first_line} {f.name} ({f.lines} lines)")
    assert scanned > 100, f"the scanner found only {scanned} functions: it is broken"
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (break them up): {over}"


def test_getenv_in_one_file_of_src():
    readers = [_rel(p) for p in _sources("src") if "getenv" in _read(p)]
    assert len(readers) == 1, (
        f"getenv appears in {readers}: the environment is read in one place (the Settings, src/torch/settings.cc); "
        "add the variable there instead"
    )


# --- the scanner itself ---------------------------------------------------------------------------------------

_SNIPPET_HEAD = r'''
#include <string>
#define BRACES_IN_A_MACRO { {
#define CONTINUED(x) \
  { x; }
namespace outer {
namespace {
// a comment with a brace {
const char* kOpen = "{{{ not code";  /* } nor this { */
char kClose = '}';
const char* kRaw = R"js(function f() { return "}"; })js";
int numbers = 1'000'000;
}  // namespace

struct Holder : public Base<Holder> {
  Holder() : a_{1}, b_(2) { work(); }
 public:
  int short_method() const { return a_ + '{'; }
  int a_, b_;
};

int table[] = {1, 2, 3};

int long_function(int x) {
  std::string s = "}";
'''

_SNIPPET_TAIL = r'''
  auto inner = [&](int y) { return y + x; };
  return inner(1);
}

int after() { return 0; }
}  // namespace outer
'''


def _snippet(body_lines: int) -> str:
    body = "".join(f"  x += {k};  // {{ line {k}\n" for k in range(body_lines))
    return _SNIPPET_HEAD + body + _SNIPPET_TAIL


def test_scanner_finds_a_long_function():
    found = {f.name: f for f in functions(_snippet(84))}
    assert set(found) == {"Holder", "short_method", "long_function", "after"}, found
    # signature, the string line, 84 body lines, the lambda, the return, the closing brace
    assert found["long_function"].lines == 90, found["long_function"]
    assert found["after"].lines == 1
    assert found["short_method"].lines == 1
    assert found["Holder"].lines == 1
    over = [f.name for f in found.values() if f.lines > MAX_FUNCTION_LINES]
    assert over == ["long_function"]


def test_scanner_passes_a_short_function():
    found = {f.name: f for f in functions(_snippet(70))}
    assert found["long_function"].lines == 76
    assert all(f.lines <= MAX_FUNCTION_LINES for f in found.values())


def test_scanner_ignores_braces_in_literals_and_comments():
    code = strip_cxx(_snippet(3))
    assert code.count("{") == code.count("}")
    assert "not code" not in code and "return \"}\"" not in code and "a comment" not in code
    assert len(code.splitlines()) == len(_snippet(3).splitlines())  # line numbers kept


def test_scanner_rejects_unbalanced_code():
    with pytest.raises(ValueError, match="unclosed"):
        functions("int f() {\n  if (x) {\n  return 1;\n}\n")
