"""The documentation (README.md, docs/*.md, mkdocs.yml) still builds, links and runs. Pure and fast: no process group,
no network, no download.

* ``mkdocs build --strict`` of the site succeeds (skipped only where mkdocs is not installed; the ``test`` extra
  installs it). mkdocs itself fails on broken anchors and pages left out of the nav; links to files outside
  ``docs/`` are not its to check (they are outside its site), so this file checks every relative link instead:
* every relative link, ``[text](target)`` or ``<a href="target">``, in README.md and docs/*.md names an existing
  file or folder of the repository, and its ``#anchor`` a heading of the Markdown file it points to (slugged as
  GitHub does and, for docs pages, as mkdocs does too: the link must work in both places). External
  ``http(s)`` links are not fetched, only collected and checked for form;
* every repository path written as code (`` `benchmarks/MEMORY.md` ``, `` `lightning_hybrid/parallel/zero/` ``) exists,
  so a figure's source file or a module's entry cannot go stale silently;
* every fenced ``python`` block compiles. **Runnable snippets**: a ``python`` block whose fence is directly
  preceded by the line ``<!-- runnable -->`` is executed, from the repository root, in a namespace of its own; it
  must finish in a few seconds on a CPU without a process group or a download, and should assert what it shows.
  Leave the marker off anything that launches ranks or reads files that are not in the repository;
* every shell command in a fenced ``bash``/``console``/``sh`` block or an inline code span: the script it runs
  exists (``python recipes/pretrain.py``, ``python -m lightning_hybrid.planner``), a ``make`` target is in the
  Makefile, a ``pip`` extra is in pyproject.toml, and a recipe's Hydra overrides compose (``parallel=3d`` needs
  ``configs/parallel/3d.yaml``; a sweep's every value is composed).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RUNNABLE = "<!-- runnable -->"


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ------------------------------------------------------------------------------------------- Markdown parsing
@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    runnable: bool

    @property
    def id(self) -> str:
        return f"{rel(self.page)}:{self.line}"


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def split_page(page: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced code blocks of ``page`` and its other lines (line number, text)."""
    blocks, prose = [], []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence, start = m.group(2), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(m.group(1)) :])
            i += 1
        i += 1  # the closing fence
        runnable = start > 0 and lines[start - 1].strip() == RUNNABLE
        blocks.append(Block(page, start + 1, m.group(3).lower(), "\n".join(body) + "\n", runnable))
    return blocks, prose


def prose_text(page: Path) -> str:
    """The page outside fenced blocks, lines kept in place (blank for the blocks' lines) so that spans keep lines."""
    lines = [""] * len(page.read_text().splitlines())
    for number, text in split_page(page)[1]:
        lines[number - 1] = text
    return "\n".join(lines)


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def code_spans(page: Path) -> list[tuple[int, str]]:
    """Inline code spans (line, content); a span never crosses a paragraph break."""
    text = prose_text(page)
    spans = []
    for m in _CODE_SPAN.finditer(text):
        if "\n\n" in m.group(2):
            continue
        spans.append((text.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())))
    return spans


def without_code_spans(text: str) -> str:
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)) if "\n\n" not in m.group(2) else m.group(0), text)


_MD_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"<a\s[^>]*?href=\"([^\"]+)\"", re.I)


def links(page: Path) -> list[tuple[int, str]]:
    text = without_code_spans(prose_text(page))
    found = []
    for pattern in (_MD_LINK, _HTML_LINK):
        for m in pattern.finditer(text):
            found.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return sorted(found)


# ------------------------------------------------------------------------------------------- heading slugs
def _heading_text(markdown: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown)  # a link's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return text.replace("`", "").replace("*", "").strip().rstrip("#").strip()


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, each space a ``-``."""
    text = _heading_text(heading).lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's ``toc`` slugify (mkdocs' default): ASCII-folded, punctuation dropped, runs of spaces and
    ``-`` one ``-``."""
    text = unicodedata.normalize("NFKD", _heading_text(heading)).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> dict[str, set[str]]:
    """``{"github": slugs, "mkdocs": slugs}`` of a Markdown file's headings (repeats numbered as each does) and of
    explicit ``id``/``name`` attributes."""
    result: dict[str, set[str]] = {"github": set(), "mkdocs": set()}
    seen: dict[str, dict[str, int]] = {"github": {}, "mkdocs": {}}
    for _, line in split_page(page)[1]:
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            for kind, slug, sep in (("github", github_slug(m.group(1)), "-"), ("mkdocs", mkdocs_slug(m.group(1)), "_")):
                n = seen[kind].get(slug, 0)
                seen[kind][slug] = n + 1
                result[kind].add(slug if n == 0 else f"{slug}{sep}{n}")
        for m in re.finditer(r"\s(?:id|name)=\"([^\"]+)\"", line):
            result["github"].add(m.group(1))
            result["mkdocs"].add(m.group(1))
    return result


# ------------------------------------------------------------------------------------------- the site
def test_mkdocs_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[test]' installs it)")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_docs_page_is_in_the_nav_and_linked_from_the_readme_and_the_index():
    nav = (ROOT / "mkdocs.yml").read_text()
    readme = {target.split("#")[0] for _, target in links(ROOT / "README.md")}
    index = {target.split("#")[0] for _, target in links(DOCS / "index.md")}
    problems = []
    for page in sorted(DOCS.glob("*.md")):
        if not re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.M):
            problems.append(f"{page.name} is not in mkdocs.yml's nav")
        if rel(page) not in readme:
            problems.append(f"README.md does not link {rel(page)}")
        if page.name != "index.md" and page.name not in index:
            problems.append(f"docs/index.md does not link {page.name}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------- links
def _check_link(page: Path, target: str) -> str | None:
    """None if ``target`` (relative to ``page``) resolves, else what is wrong."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return None  # external: test_external_links_are_well_formed
    if target.startswith("/"):
        return "an absolute link (mkdocs leaves it unresolved): write it relative to this file"
    path = unquote(parts.path)
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{rel(file) if file.is_relative_to(ROOT) else file} does not exist"
    if not file.is_relative_to(ROOT):
        return "points outside the repository"
    if parts.fragment:
        if file.suffix != ".md":
            return f"an anchor into {rel(file)}, which is not Markdown"
        slugs = anchors(file)
        kinds = ["github", "mkdocs"] if file.parent == DOCS else ["github"]
        for kind in kinds:
            if parts.fragment not in slugs[kind]:
                return (
                    f"{rel(file)} has no heading with the {kind} anchor #{parts.fragment} (has {sorted(slugs[kind])})"
                )
    return None


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    problems = [
        f"{rel(page)}:{line}: ({target}) {why}"
        for line, target in links(page)
        if (why := _check_link(page, target)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_external_links_are_well_formed():
    """Not fetched (no network here): listed, and each must at least be a whole http(s) URL."""
    external = [
        (rel(page), line, target)
        for page in PAGES
        for line, target in links(page)
        if urlsplit(target).scheme or urlsplit(target).netloc
    ]
    for where, line, target in external:
        print(f"external link, not fetched: {where}:{line}: {target}")
        parts = urlsplit(target)
        assert parts.scheme in ("http", "https") and parts.netloc, f"{where}:{line}: {target} is not an http(s) URL"


_REPO_DIRS = ("lightning_hybrid", "tests", "benchmarks", "configs", "recipes", "docs", ".ci")
_REPO_PATH = re.compile(rf"^(?:\./)?(?:{'|'.join(re.escape(d) for d in _REPO_DIRS)})/[\w./-]*$")


def _repo_path_problem(token: str) -> str | None:
    token = token.strip("'\",;:()")
    if not _REPO_PATH.match(token):
        return None
    return None if (ROOT / token).exists() else f"{token} does not exist"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_repository_paths_in_code_exist(page):
    problems = []
    for line, span in code_spans(page):
        for token in span.split():
            if (why := _repo_path_problem(token)) is not None:
                problems.append(f"{rel(page)}:{line}: `{span}`: {why}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------- Python snippets
BLOCKS = [block for page in PAGES for block in split_page(page)[0]]
PYTHON = [block for block in BLOCKS if block.lang in ("python", "py")]


def test_runnable_snippets_are_marked():
    """The convention is used (at least three snippets run), and the marker is never left on something else."""
    assert sum(block.runnable for block in PYTHON) >= 3
    stray = [block.id for block in BLOCKS if block.runnable and block not in PYTHON]
    assert not stray, f"{RUNNABLE} marks blocks that are not python: {stray}"
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == RUNNABLE:
                assert i + 1 < len(lines) and _FENCE.match(lines[i + 1]), (
                    f"{rel(page)}:{i + 1}: {RUNNABLE} not right above a fence"
                )


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_snippet_compiles(block):
    compile(block.source, block.id, "exec")


@pytest.mark.parametrize("block", [b for b in PYTHON if b.runnable], ids=lambda b: b.id)
def test_runnable_snippet_runs(block, monkeypatch):
    monkeypatch.chdir(ROOT)
    exec(compile(block.source, block.id, "exec"), {"__name__": f"snippet:{block.id}"})


# ------------------------------------------------------------------------------------------- shell commands
SHELL = ("bash", "sh", "console", "shell")


def _commands(text: str) -> list[list[str]]:
    """Commands (tokens) of shell text: continuation lines joined, comments dropped, ``$ `` prompts removed."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            tokens = line.split()
        while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # VAR=value prefixes
            tokens = tokens[1:]
        if tokens:
            commands.append(tokens)
    return commands


def _shell_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in split_page(page)[0]:
            if block.lang in SHELL:
                found += [(block.id, tokens) for tokens in _commands(block.source)]
        for line, span in code_spans(page):
            if re.match(r"^(?:[A-Z_]+=\S+\s+)*(python|make|pip|pytest|torchrun)\b", span):
                found += [(f"{rel(page)}:{line}", tokens) for tokens in _commands(span)]
    return found


SHELL_COMMANDS = _shell_commands()


def _config_groups() -> set[str]:
    """The Hydra config groups: the folders under configs/ (``hydra/launcher`` included)."""
    return {p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*") if p.is_dir()}


def _compose(config_name: str, overrides: list[str]) -> None:
    from hydra import compose, initialize_config_dir

    from lightning_hybrid.runs.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        compose(
            config_name=config_name,
            overrides=overrides,
            return_hydra_config=any(o.startswith("hydra") for o in overrides),
        )


def _check_recipe(script: str, args: list[str]) -> list[str]:
    """A recipe's overrides: each config group's option exists, and they compose with the recipe's config (under
    ``-m``, each value of a sweep in turn)."""
    sweep = "-m" in args or "--multirun" in args
    choices = []
    problems = []
    for override in (a for a in args if not a.startswith("-") and a != "..." and "=" in a):
        key, _, value = re.sub(r"<[\w-]+>", "placeholder", override).partition("=")  # `<partition>`: yours
        values = value.split(",") if sweep and not value.startswith("[") else [value]
        if key.lstrip("+~") in _config_groups():
            problems += [
                f"{key}={v}: no configs/{key}/{v}.yaml, nor a registered {key} option"
                for v in values
                if not _option_exists(key.lstrip("+~"), v)
            ]
        choices.append((key, values))
    if problems:
        return problems
    first = [f"{key}={values[0]}" for key, values in choices]
    runs = [first] + [
        first[:i] + [f"{key}={v}"] + first[i + 1 :] for i, (key, values) in enumerate(choices) for v in values[1:]
    ]
    for run in runs:
        try:
            _compose(Path(script).stem, run)
        except Exception as e:  # noqa: BLE001 -- reported with the command
            problems.append(
                f"{' '.join(run)} does not compose with configs/{Path(script).stem}.yaml: {type(e).__name__}: {e}"
            )
    return problems


def _option_exists(group: str, option: str) -> bool:
    if (ROOT / "configs" / group / f"{option}.yaml").is_file():
        return True
    from hydra.core.config_store import ConfigStore

    from lightning_hybrid.runs.config import register_configs

    register_configs()
    try:
        return f"{option}.yaml" in ConfigStore.instance().list(group)
    except OSError:
        return False


def _python_module_file(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def _extras() -> set[str]:
    """The names under pyproject.toml's ``[project.optional-dependencies]`` (read as text: no tomllib on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def _check_command(tokens: list[str]) -> list[str]:
    problems = [why for token in tokens if (why := _repo_path_problem(token)) is not None]
    program, args = tokens[0], tokens[1:]
    if program in ("python", "python3"):
        if args[:1] == ["-m"] and len(args) > 1:
            if args[1].startswith("lightning_hybrid") and _python_module_file(args[1]) is None:
                problems.append(f"python -m {args[1]}: no such module (or package with __main__.py)")
        elif args and args[0].endswith(".py") and "/" in args[0]:
            if not (ROOT / args[0]).is_file():
                problems.append(f"{args[0]} does not exist")
            elif args[0].startswith("recipes/"):
                problems += _check_recipe(args[0], args[1:])
    elif program == "make":
        makefile = (ROOT / "Makefile").read_text()
        for target in (a for a in args if not a.startswith("-") and "=" not in a):
            if not re.search(rf"^{re.escape(target)}\s*:", makefile, re.M):
                problems.append(f"make {target}: no such target in the Makefile")
    elif program == "pip":
        extras = _extras()
        for arg in args:
            m = re.match(r"^\.\[([\w,-]+)\]$", arg)
            if m:
                missing = [e for e in m.group(1).split(",") if e not in extras]
                problems += [f"pip extra [{e}] is not in pyproject.toml" for e in missing]
    return problems


@pytest.mark.parametrize("where,tokens", SHELL_COMMANDS, ids=[f"{w}:{t[0]}" for w, t in SHELL_COMMANDS])
def test_shell_command_names_what_exists(where, tokens):
    problems = _check_command(tokens)
    assert not problems, f"{where}: {' '.join(tokens)}\n" + "\n".join(problems)
