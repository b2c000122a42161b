"""Check the README and every page under docs/ against the code, so that a renamed flag, config
key or file fails the tests instead of a reader.

    python -m tools.check_docs            # every page; one line per problem, exit 1 if any
    python -m tools.check_docs docs/clusters.md --no-run

What is checked, page by page:

- **Shell blocks** (```` ```bash ````, ``sh``, ``console``) carry a marker on the line before the fence
  saying how they are checked, ``<!-- check: MODE -->``:
  - ``run``: each command runs for real and must exit 0 (only where it is cheap);
  - ``dry-run``: the same, and each command must contain ``--dry-run`` or ``DRY_RUN=1``;
  - ``help``: not run: the program must exist and each flag it is given must appear in its
    ``--help`` (a ``make`` target must exist in the Makefile, a launch script's environment
    variables must be read by the script);
  - ``skip: <why>``: not a command of this project (an output sample, a cluster's own shell).
  In every mode, the repository files a command names must exist.
- **File blocks** (any language), marked ``<!-- check: file NAME -->``: the block is the whole file
  ``NAME`` (a relative path, ``my_topics/train.csv``) that the page's reader writes. Before the
  page's ``run`` blocks run, the checker writes each into a scratch directory (a new one whenever
  their text changes), and an argument naming such a file or its top folder (``my_topics``) names
  the one written there. Outputs go there too: an argument under ``runs/`` is put under the same
  scratch directory (unless it exists: a model ``make demo`` trained), so checking the docs writes
  nothing into the repository. A path that stands for something of the reader's
  (``runs/demo/checkpoints``: a model) is replaced by what the checker is given for it
  (``stand_ins``; ``--stand-in`` on the command line), else read where it is.
- **YAML blocks**: every mapping key must be a config key; a block marked ``<!-- check: recipe -->``
  must validate as a whole recipe. ``<!-- check: recipe NAME -->`` is also the file ``NAME`` the
  reader saves it as (a file block), so the page's ``run`` command trains it as written; its
  outputs (values under ``runs/``) go to the scratch directory, as a command's do.
  Python programs run in this process (``runpy``), so a block costs an import, not a new
  interpreter; a launch script or ``make`` runs in a subprocess.
- **Inline code**: ``--flag`` must be a flag of one of the programs the docs name (or of the
  cluster tools listed in :data:`EXTERNAL_FLAGS`); ``section.key`` (``training.rope_fusion``) must be
  a field of that recipe section; ``key: value`` must be a key of a recipe, phase, objective or
  study; a repository path (``megatron_ext/...``, ``examples/...``, ``checkpoint/lock.py`` inside the
  package) must exist; ``megatron_ext.x.y`` must be importable.
- **Error messages**: in a table after ``<!-- check: messages -->``, the code in each row's first
  cell (split at ``...``) must appear in the package's source: the line is still printed.
- **No internal issue numbers** in prose.
- **Links**: every relative link must resolve, and its ``#anchor`` must be a heading of the target.

Where a page must say something the checker would refuse (a removed key, say), it writes it in
plain text, not as code.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import hashlib
import importlib
import importlib.util
import io
import logging
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import tomllib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_ext.cli.megatron_flags import megatron_lm_flags

REPO = Path(__file__).resolve().parent.parent

SHELL_LANGS = ("bash", "sh", "shell", "console")
MODES = ("run", "dry-run", "help", "skip")
"""How a shell block is checked; a table after ``<!-- check: messages -->`` quotes error lines."""
FILE_MODE = "file"
"""A block marked ``<!-- check: file NAME -->`` is the whole file NAME of the reader's, written
before the page's commands run."""
OUTPUTS = "runs/"
"""Where the pages' commands write (ignored by git): the checker writes there in its scratch directory."""
MARKER = re.compile(r"^<!--\s*check:\s*(?P<mode>[a-z-]+)(?P<rest>[^>]*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(?P<code>.+?)(?<!`)\1(?!`)")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
DOTTED_KEY = re.compile(r"^(?P<section>[a-z_]+)\.(?P<key>[A-Za-z_][A-Za-z0-9_]*)(?P<rest>(?::\s.*|\s*=.*)?)$")
KEY_VALUE = re.compile(r"^(?P<key>[a-z][a-z0-9_]*):\s+\S")
ISSUE_NUMBER = re.compile(r"\b(?:issue|issues|PR)\s+#?\d+|#\d{2,}\b", re.I)
"""The project's own issue numbers mean nothing to a reader."""
MODULE = re.compile(r"^megatron_ext(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".sh", ".sbatch", ".md", ".toml", ".json", ".txt", ".cfg")
FILE_SUFFIXES = (*SOURCE_SUFFIXES, ".safetensors", ".bin", ".idx", ".jsonl", ".png", ".gguf", ".pt", ".tsv", ".csv",
                 ".log", ".out", ".model")
"""What ends a file name: ``model.safetensors`` is a file, not the recipe key ``model.safetensors``."""
PLACEHOLDER_CHARS = set("<>{}*?[]…$~ ")

EXTERNAL_FLAGS: dict[str, tuple[str, ...]] = {
    # flags of other programs the pages name, by program (not checked against this project's tools)
    "sbatch": ("--signal", "--array", "--partition", "--nodes", "--gpus-per-node", "--time", "--dependency",
               "--kill-on-invalid-dep", "--ntasks-per-node", "--job-name", "--output", "--account", "--qos",
               "--exclusive", "--gres", "--mem", "--cpus-per-task"),
    "scancel": ("--signal", "--batch", "--full"),
    "torchrun": ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                 "--master-addr", "--master-port", "--standalone"),
    "pip": ("--no-index", "--find-links", "--no-deps", "--no-build-isolation", "--config-settings", "--platform",
            "--only-binary", "--python-version", "--dest", "--index-url", "--extra-index-url", "--upgrade",
            "--no-cache-dir", "--require-hashes", "--build-option"),
    "pytest": ("--durations", "--dist", "--no-loadscope-reorder", "--timeout"),
    "docker": ("--gpus", "--ipc", "--ulimit", "--rm", "--shm-size"),
    "wandb": ("--sync-all",),
}
EXTERNAL_FLAGS["megatron-lm"] = tuple(megatron_lm_flags())  # Megatron-LM 0.19's own list (megatron_flags.py)
EXTERNAL_COMMANDS = ("python -m venv", "python -m pip", "pip", "ldd", "nvcc", "git", "docker", "apptainer", "sbatch",
                     "scancel", "srun", "squeue", "scontrol", "sacct", "torchrun", "apt-get", "make", "pytest", "wandb",
                     "nvidia-smi", "enroot", "singularity", "NVCC_APPEND_FLAGS")
"""Commands of other programs: a code span that starts with one has its flags left unchecked."""


# -- what the code defines -----------------------------------------------------------------------


@functools.cache
def _pyproject_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


@dataclass(frozen=True, kw_only=True)
class Program:
    """A program a command names: a script of the repository, a module, or a console script."""

    name: str
    """How the docs name it: ``tools/evaluate.py``, ``-m megatron_ext.eval.families.sts``, ``megatron-ext-evaluate``."""
    script: Path | None = None
    module: str | None = None
    entry: str | None = None
    """``module:function`` of a console script."""

    def run(self, args: list[str], *, env: dict[str, str] | None = None) -> tuple[int, str]:
        """Run in this process with ``args``; returns the exit status and stdout + stderr. The
        process's argv, environment, working directory, warning filters and root logger are
        restored afterwards (the docs' commands run inside the test process: no interpreter start)."""
        out = io.StringIO()
        saved_argv, saved_env, saved_cwd = sys.argv[:], dict(os.environ), os.getcwd()
        os.environ.update(env or {})
        os.environ.setdefault("COLUMNS", "100")
        code = 0
        root = logging.getLogger()
        saved_logging = (root.level, root.handlers[:])
        try:
            os.chdir(REPO)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
                if self.script is not None:
                    sys.argv = [str(self.script), *args]
                    runpy.run_path(str(self.script), run_name="__main__")
                elif self.module is not None:
                    sys.argv = [self.module, *args]
                    # A module this process imported already (tools.check_docs, a benchmark a test
                    # imported) runs again as __main__, as in its own process: runpy's warning about
                    # the first copy says nothing about the command.
                    warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package",
                                            RuntimeWarning)
                    runpy.run_module(self.module, run_name="__main__", alter_sys=True)
                else:
                    module, function = self.entry.split(":")
                    code = getattr(importlib.import_module(module), function)(args) or 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        finally:
            root.setLevel(saved_logging[0])
            root.handlers[:] = saved_logging[1]
            sys.argv = saved_argv
            os.environ.clear()
            os.environ.update(saved_env)
            os.chdir(saved_cwd)
        return code, out.getvalue()


_HELP: dict[str, str] = {}


def program_help(program: Program) -> str:
    """The program's ``--help`` text (run once per program, in this process); a shell script's
    whole text (its flags are read from its argument parsing)."""
    if program.script is not None and program.script.suffix in (".sh", ".sbatch"):
        return program.script.read_text()
    if program.name not in _HELP:
        code, text = program.run(["--help"], env={"COLUMNS": "100"})
        if code != 0:
            raise RuntimeError(f"{program.name} --help exited {code}: {text[-2000:]}")
        _HELP[program.name] = text
    return _HELP[program.name]


def help_flags(program: Program) -> set[str]:
    return set(FLAG.findall(program_help(program)))


def find_program(tokens: list[str]) -> tuple[Program | None, list[str], str | None]:
    """The program of a command line (after its environment assignments) and its arguments; or
    None and the reason when the command is not one of this project's Python programs."""
    if not tokens:
        return None, [], "empty"
    head = tokens[0]
    scripts = _pyproject_scripts()
    if head in scripts:
        return Program(name=head, entry=scripts[head]), tokens[1:], None
    if head == "torchrun":
        for i, token in enumerate(tokens[1:], start=1):
            if token.endswith(".py"):
                return Program(name=token, script=REPO / token), tokens[i + 1:], None
        return None, [], "torchrun without a script"
    if re.fullmatch(r"(\S*/)?python(3(\.\d+)?)?|\$PY|\$\{?PYTHON\}?", head):
        rest = tokens[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return Program(name=f"-m {rest[1]}", module=rest[1]), rest[2:], None
        if rest and rest[0].endswith(".py"):
            return Program(name=rest[0], script=REPO / rest[0]), rest[1:], None
        return None, [], "python without a script"
    if head.endswith(".py"):
        return Program(name=head, script=REPO / head), tokens[1:], None
    return None, [], "not a Python program"


def _dataclass_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


@dataclass(frozen=True, kw_only=True)
class ConfigKeys:
    """Every key a recipe, phase, objective, study file or evaluation section may hold."""

    sections: dict[str, set[str]]
    """Recipe section -> its keys."""
    all_keys: set[str]


def config_keys() -> ConfigKeys:
    from megatron_ext import objectives
    from megatron_ext.phases import Phase
    from megatron_ext.study import spec
    from megatron_ext.training.config import SECTIONS
    from megatron_ext.training.recipe import TOP_LEVEL_KEYS

    sections = {name: set(_dataclass_fields(cls)) for name, cls in SECTIONS.items()}
    sections["model"].add("preset")  # read by the recipe loader, not a field of the model's config
    keys = set(TOP_LEVEL_KEYS) | {"name"} | set(_dataclass_fields(Phase))
    for fields in sections.values():
        keys |= fields
    for cls in objectives.OBJECTIVES.values():
        keys |= set(_dataclass_fields(cls))
    keys |= set(_dataclass_fields(objectives.MaskingConfig))
    from megatron_ext.eval.finetuning import FinetuneConfig  # a study's evaluation settings

    keys |= set(_dataclass_fields(FinetuneConfig))
    for value in vars(spec).values():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == spec.__name__:
            keys |= set(_dataclass_fields(value))
    from megatron_ext.launch import LAUNCHERS, Resources  # a study's resources: neutral keys, launchers' flags

    keys |= set(_dataclass_fields(Resources)) | set(LAUNCHERS)
    return ConfigKeys(sections=sections, all_keys=keys)


# -- reading a page ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Problem:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass(frozen=True, kw_only=True)
class CodeBlock:
    line: int
    """Line of the opening fence (1-based)."""
    lang: str
    mode: str | None
    note: str
    text: str


@dataclass(frozen=True, kw_only=True)
class Command:
    line: int
    env: dict[str, str]
    tokens: list[str]
    text: str


def code_blocks(text: str) -> Iterator[CodeBlock]:
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, start = match["fence"], i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(prev)
        yield CodeBlock(line=start + 1, lang=match["lang"].lower(), mode=marker["mode"] if marker else None,
                        note=marker["rest"].strip(" :") if marker else "", text="\n".join(lines[start + 1:j]))
        i = j + 1


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of everything outside code blocks and HTML comments."""
    in_fence, fence = False, ""
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if match and not in_fence:
            in_fence, fence = True, match["fence"]
            continue
        if in_fence:
            if line.strip().startswith(fence):
                in_fence = False
            continue
        yield number, re.sub(r"<!--.*?-->", "", line)


def commands(block: CodeBlock) -> Iterator[Command]:
    """The block's commands: continuation lines joined, comments and prompts dropped."""
    logical, first = "", None
    for offset, raw in enumerate(block.text.splitlines(), start=1):
        line = raw.rstrip()
        if first is None:
            first = block.line + offset
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        command, logical, line_number, first = logical.strip(), "", first, None
        if command.startswith("$ "):
            command = command[2:]
        if not command or command.startswith("#"):
            continue
        try:
            tokens = shlex.split(command, comments=True)
        except ValueError as error:
            yield Command(line=line_number, env={}, tokens=[], text=f"unparsable: {error}")
            continue
        env = {}
        while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
            key, _, value = tokens.pop(0).partition("=")
            env[key] = value
        if tokens:
            yield Command(line=line_number, env=env, tokens=tokens, text=command)


@functools.cache
def _tracked_top_level() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        names = {line.split("/")[0] for line in out.splitlines() if line}
    except (OSError, subprocess.CalledProcessError):
        names = set()
    return names | {p.name for p in REPO.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {
        "data", "runs", "wandb", ".venv"}


@functools.cache
def _package_dirs() -> set[str]:
    return {p.name for p in (REPO / "megatron_ext").iterdir() if p.is_dir() and not p.name.startswith("_")}


def path_problem(candidate: str, page: Path) -> str | None:
    """Why ``candidate`` (a path named on ``page``) does not resolve, or None (also when it is not a
    repository path: an output, a placeholder, an absolute path)."""
    candidate = candidate.strip().rstrip(".,;:")
    if not candidate or PLACEHOLDER_CHARS & set(candidate) or candidate.startswith(("/", "http", "./runs")):
        return None
    candidate = candidate.split("::")[0].split(":")[0] if candidate.count(":") else candidate
    clean = candidate.removeprefix("./")
    first = clean.split("/")[0]
    if "/" not in clean:
        return None
    roots = []
    if first in _tracked_top_level():
        roots.append(REPO)
    elif first in _package_dirs() and clean.endswith(SOURCE_SUFFIXES):
        roots.append(REPO / "megatron_ext")
    elif clean.startswith("../") or (clean.endswith(".md") and first in {"docs", ""}):
        roots.append(page.parent)
    if not roots:
        return None
    if any((root / clean).exists() for root in roots):
        return None
    return f"no such file or directory: {candidate}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    found: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match[1])
            count = found.get(base, 0)
            out.add(base if count == 0 else f"{base}-{count}")
            found[base] = count + 1
    return out


# -- the checker ---------------------------------------------------------------------------------


@dataclass(kw_only=True)
class DocsChecker:
    """Checks pages; ``run``: False skips the commands marked ``run``/``dry-run`` (their flags and
    paths are still checked)."""

    run: bool = True
    keys: ConfigKeys = dataclasses.field(default_factory=config_keys)
    known_flags: set[str] = dataclasses.field(default_factory=set)
    """Flags of every program named on the pages checked (filled while checking)."""
    runs: dict[tuple, tuple[int, str]] = dataclasses.field(default_factory=dict)
    """Exit status and output of each command run, by program, arguments and environment."""
    scratch: Path = dataclasses.field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="check_docs-")))
    """Where a page's file blocks are written and its commands' outputs (``runs/...``) go."""
    stand_ins: dict[str, str] = dataclasses.field(default_factory=dict)
    """A path a page's command names that stands for something of the reader's (a model) -> the
    path the check uses instead; without one, the command runs as written."""

    def check_pages(self, pages: Iterable[Path]) -> list[Problem]:
        pages = list(pages)
        problems, deferred = [], []
        for page in pages:  # first the blocks: they name the programs whose flags the prose may use
            text = page.read_text()
            problems += self.check_blocks(text, page)
            deferred.append((page, text))
        for name in self.program_names(text for _, text in deferred):
            with contextlib.suppress(RuntimeError):
                self.known_flags |= help_flags(name)
        for page, text in deferred:
            problems += self.check_prose(text, page)
        return problems

    def program_names(self, texts: Iterable[str]) -> list[Program]:
        """Every Python program the texts name (``tools/x.py``, ``pretrain_encoder.py``,
        ``benchmarks/x.py`` or ``-m benchmarks.x``, ``megatron-ext-x``)."""
        scripts = _pyproject_scripts()
        seen: dict[str, Program] = {}
        for text in texts:
            for match in re.finditer(r"(?<![\w/.-])((?:tools|benchmarks|examples/[\w/]+)/[\w]+\.py|pretrain_encoder\.py)",
                                     text):
                if (REPO / match[1]).is_file():
                    if module := module_program(REPO / match[1]):
                        seen.setdefault(f"-m {module}", Program(name=f"-m {module}", module=module))
                    else:
                        seen.setdefault(match[1], Program(name=match[1], script=REPO / match[1]))
            for match in re.finditer(r"(?<![\w-])-m ((?:benchmarks|tools)\.\w+)", text):
                if (REPO / f"{match[1].replace('.', '/')}.py").is_file():
                    seen.setdefault(f"-m {match[1]}", Program(name=f"-m {match[1]}", module=match[1]))
            for match in re.finditer(r"(?<![\w/.-])((?:tools|benchmarks|examples/[\w/]+)/[\w]+\.sh)", text):
                if (REPO / match[1]).is_file():
                    seen.setdefault(match[1], Program(name=match[1], script=REPO / match[1]))
            for match in re.finditer(r"(?<![\w-])(megatron-ext-[a-z-]+)", text):
                if match[1] in scripts:
                    seen.setdefault(match[1], Program(name=match[1], entry=scripts[match[1]]))
        return list(seen.values())

    def check_text(self, text: str, page: Path) -> list[Problem]:
        """One page's problems (the page's own programs give the prose its flags)."""
        problems = self.check_blocks(text, page)
        for program in self.program_names([text]):
            with contextlib.suppress(RuntimeError):
                self.known_flags |= help_flags(program)
        return problems + self.check_prose(text, page)

    # blocks

    def check_blocks(self, text: str, page: Path) -> list[Problem]:
        rel = _rel(page)
        problems = []
        blocks = list(code_blocks(text))
        files_root, file_problems = self.write_file_blocks(
            [b for b in blocks if b.mode == FILE_MODE or (b.mode == "recipe" and b.note)])
        problems += [Problem(path=rel, line=line, message=message) for line, message in file_problems]
        for block in blocks:
            where = lambda line, message: Problem(path=rel, line=line, message=message)  # noqa: E731
            if block.mode == FILE_MODE:
                continue
            if block.lang in ("yaml", "yml"):
                problems += [where(block.line, m) for m in self.yaml_problems(block.text)]
                if block.mode == "recipe" and not problems:
                    problems += [where(block.line, m) for m in recipe_problems(block.text)]
                continue
            if block.lang not in SHELL_LANGS:
                continue
            if block.mode is None:
                problems.append(where(block.line, f"a {block.lang} block without a marker "
                                                  f"(<!-- check: {'|'.join(MODES)} --> on the line before it)"))
                continue
            if block.mode not in MODES:
                problems.append(where(block.line, f"unknown check mode {block.mode!r} (expected one of {MODES})"))
                continue
            if block.mode == "skip":
                if not block.note:
                    problems.append(where(block.line, "a skipped block says why: <!-- check: skip: <why> -->"))
                continue
            for command in commands(block):
                problems += [where(command.line, m)
                             for m in self.command_problems(command, block.mode, page, files_root=files_root)]
        return problems

    def write_file_blocks(self, blocks: list[CodeBlock]) -> tuple[Path, list[tuple[int, str]]]:
        """Write a page's file blocks (when commands run) under a scratch directory named after
        their text, so a page whose files changed runs its commands anew; returns that directory
        and the (line, problem) of each block whose name is not a relative path."""
        problems, files = [], {}
        for block in blocks:
            name = Path(block.note)
            if not block.note or name.is_absolute() or ".." in name.parts:
                problems.append((block.line, "a file block names a relative path: "
                                             "<!-- check: file my_dir/train.csv -->"))
            elif block.note in files:
                problems.append((block.line, f"a second file block for {block.note}"))
            else:
                files[block.note] = block
        digest = hashlib.sha256(repr(sorted((name, b.text) for name, b in files.items())).encode()).hexdigest()[:12]
        root = self.scratch / (f"files-{digest}" if files else "outputs")
        if self.run:
            for name, block in files.items():
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                content = block.text + "\n"
                if block.mode == "recipe":  # the recipe's outputs (runs/...) go where commands' outputs go
                    content = yaml.safe_dump(_outputs_under(yaml.safe_load(block.text), root), sort_keys=False)
                (root / name).write_text(content, encoding="utf-8")
        return root, problems

    def _argument(self, arg: str, files_root: Path) -> str:
        """``arg`` as the check runs it: a stand-in's path, a file block's path in the scratch
        directory, an output (``runs/...``) under it; else as written (also after ``NAME=`` or
        ``--flag=``)."""
        match = re.fullmatch(r"(?P<head>(?:--[\w-]+|[\w.+-]+)=)?(?P<path>.+)", arg)
        head, path = match["head"] or "", match["path"]
        if path in self.stand_ins:
            return head + self.stand_ins[path]
        top = Path(path).parts[0] if path and not path.startswith("-") else ""
        written = top and (files_root / top).exists() and top not in _tracked_top_level()
        # Under runs/: an output, unless it is already there (``runs/demo/checkpoints`` after
        # ``make demo``: the model the page's command reads).
        if written or (path.startswith(OUTPUTS) and not (REPO / path).exists()):
            return head + str(files_root / path)
        return arg

    def command_problems(self, command: Command, mode: str, page: Path, *,
                         files_root: Path | None = None) -> list[str]:
        if not command.tokens:
            return [command.text]
        problems = [problem for token in command.tokens for value in [token.partition("=")[2] or token]
                    if (problem := path_problem(value, page))]
        if mode == "dry-run" and "--dry-run" not in command.tokens and command.env.get("DRY_RUN") != "1":
            problems.append(f"a dry-run block's command without --dry-run or DRY_RUN=1: {command.text}")
        if problems:
            return problems
        head = command.tokens[0]
        if head == "make":
            return self.make_problems(command, mode)
        if head in ("bash", "sh", "sbatch", "srun") or head.endswith((".sh", ".sbatch")):
            return self.script_problems(command, mode)
        program, args, why = find_program(command.tokens)
        if program is None:
            if mode in ("run", "dry-run"):
                return [f"cannot run {head!r} ({why}); mark the block help or skip"]
            return []
        if program.script is not None and not program.script.is_file():
            return [f"no such program: {program.name}"]
        if program.script is not None and (module := module_program(program.script)):
            return [f"{program.name} is a module of the checkout's {module.partition('.')[0]} package: "
                    f"run it as python -m {module}"]
        if program.module is not None and not _module_exists(program.module):
            return [f"no such module: {program.module}"]
        try:
            flags = help_flags(program)
        except RuntimeError as error:
            return [str(error)]
        for arg in args:
            flag = arg.split("=")[0]
            if FLAG.fullmatch(flag) and flag not in flags and flag != "--help":
                near = difflib.get_close_matches(flag, sorted(flags), n=1)
                problems.append(f"{program.name} has no flag {flag}" + (f" (did you mean {near[0]}?)" if near else ""))
        if problems or mode not in ("run", "dry-run") or not self.run:
            return problems
        files_root = files_root or self.scratch / "outputs"
        args = [self._argument(a, files_root) for a in args if a not in ("[", "]")]
        key = (program.name, tuple(args), tuple(sorted(command.env.items())))
        if key not in self.runs:  # a command on several pages (or checked twice) runs once
            self.runs[key] = program.run(args, env=command.env)
        code, output = self.runs[key]
        if code != 0:
            return [f"exited {code}: {command.text}\n{output[-1500:]}"]
        return []

    def make_problems(self, command: Command, mode: str) -> list[str]:
        makefile = (REPO / "Makefile").read_text()
        targets = set(re.findall(r"^([\w.-]+):", makefile, flags=re.M))
        problems = []
        for token in command.tokens[1:]:
            if "=" in token:
                variable = token.split("=")[0]
                if not re.search(rf"\b{re.escape(variable)}\b", makefile):
                    problems.append(f"the Makefile does not use {variable}")
            elif not token.startswith("-") and token not in targets:
                problems.append(f"no make target {token!r} (the Makefile has {sorted(targets)})")
        if not problems and mode in ("run", "dry-run"):
            problems.append("make commands are marked help: the targets run minutes to hours")
        return problems

    def script_problems(self, command: Command, mode: str) -> list[str]:
        script = next((t for t in command.tokens if t.endswith((".sh", ".sbatch"))), None)
        if script is None:
            return [] if mode == "help" else [f"no script in {command.text!r}"]
        path = REPO / script
        if not path.is_file():
            return [f"no such script: {script}"]
        body = path.read_text() + "".join(
            (path.parent / name).read_text() for name in re.findall(r"([\w-]+\.sh)", path.read_text())
            if (path.parent / name).is_file())
        problems = [f"{script} does not read {name}" for name in command.env if not re.search(rf"\b{name}\b", body)]
        if problems or mode == "help" or not self.run:
            return problems
        env = {**os.environ, **command.env, "PYTHONPATH": str(REPO), "PYTHON": command.env.get("PYTHON", sys.executable)}
        shell = ["bash" if command.tokens[0] in ("sbatch", "srun") else command.tokens[0]]
        argv = shell + command.tokens[command.tokens.index(script):] if shell[0] in ("bash", "sh") else command.tokens
        result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            return [f"exited {result.returncode}: {command.text}\n{(result.stdout + result.stderr)[-1500:]}"]
        return []

    def yaml_problems(self, text: str) -> list[str]:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            return [f"invalid YAML: {str(error).splitlines()[0]}"]
        problems = []

        def walk(node, section: str | None) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    if section in self.keys.sections and section != "phases":
                        if key not in self.keys.sections[section]:
                            problems.append(f"{section}: no key {key!r}")
                    elif isinstance(key, str) and key not in self.keys.all_keys and section != "overrides":
                        problems.append(f"no config key {key!r}")
                    if section in self.keys.sections:
                        continue  # a section's values are its settings, not keys
                    walk(value, key if isinstance(key, str) else None)
            elif isinstance(node, list):
                for item in node:
                    walk(item, None)

        walk(data, None)
        return problems

    # prose

    def check_prose(self, text: str, page: Path) -> list[Problem]:
        rel = _rel(page)
        problems = []
        all_flags = self.known_flags | {f for flags in EXTERNAL_FLAGS.values() for f in flags}
        in_messages = False
        for number, line in prose_lines(text):
            if MARKER.match(line.strip() or "-") is None and not line.startswith("|"):
                in_messages = False
            if (marker := MARKER.match(text.splitlines()[number - 1].strip())) and marker["mode"] == "messages":
                in_messages = True
                continue
            lines = text.splitlines()
            is_header = number < len(lines) and re.match(r"^\|[-\s|:]+\|?$", lines[number])
            skip_first_cell = (in_messages and line.startswith("|") and not is_header
                               and not re.match(r"^\|[-\s|:]+\|?$", line))
            if skip_first_cell:
                first_cell = line.split("|")[1]
                problems += [Problem(path=rel, line=number, message=m) for m in message_problems(first_cell)]
                line = "|" + "|".join(line.split("|")[2:])
            for match in INLINE_CODE.finditer(line):
                for message in self.span_problems(match["code"].strip(), page, all_flags):
                    problems.append(Problem(path=rel, line=number, message=message))
            if (match := ISSUE_NUMBER.search(line)) is not None:
                problems.append(Problem(path=rel, line=number, message=f"an internal issue number: {match[0]!r}; "
                                                                       "say what the change was instead"))
            for match in LINK.finditer(INLINE_CODE.sub("", line)):
                if (message := link_problem(match["target"], page)) is not None:
                    problems.append(Problem(path=rel, line=number, message=message))
        return problems

    def span_problems(self, code: str, page: Path, all_flags: set[str]) -> list[str]:
        problems = []
        named = [p for p in self.program_names([code])]
        flags_here = help_flags(named[0]) if len(named) == 1 and _has_help(named[0]) else all_flags
        for flag in FLAG.findall(code):
            if flag not in flags_here and flag != "--help":
                near = difflib.get_close_matches(flag, sorted(flags_here), n=1)
                owner = named[0].name if len(named) == 1 else "any program these pages name"
                problems.append(f"`{code}`: {owner} has no flag {flag}" + (f" (did you mean {near[0]}?)" if near else ""))
        if code.startswith(EXTERNAL_COMMANDS):
            problems = []
        if ((match := DOTTED_KEY.match(code)) and match["section"] in self.keys.sections
                and not code.endswith(FILE_SUFFIXES)
                and not _module_exists(f"megatron_ext.{match['section']}.{match['key']}")
                and not _is_attribute(f"megatron_ext.{match['section']}.{match['key']}")):
            fields = self.keys.sections[match["section"]]
            if match["key"] not in fields:
                near = difflib.get_close_matches(match["key"], sorted(fields), n=1)
                problems.append(f"`{code}`: recipe section {match['section']} has no key {match['key']}"
                                + (f" (did you mean {match['section']}.{near[0]}?)" if near else ""))
        elif (match := KEY_VALUE.match(code)) and match["key"] not in self.keys.all_keys:
            near = difflib.get_close_matches(match["key"], sorted(self.keys.all_keys), n=1)
            problems.append(f"`{code}`: no config key {match['key']}" + (f" (did you mean {near[0]}?)" if near else ""))
        if ((match := DOTTED_KEY.match(code)) and not match["rest"] and match["section"] not in self.keys.sections
                and not code.endswith(FILE_SUFFIXES)
                and _module_exists(f"megatron_ext.{match['section']}")
                and not _module_exists(f"megatron_ext.{code}") and not _is_attribute(f"megatron_ext.{code}")):
            problems.append(f"`{code}`: megatron_ext.{match['section']} has no {match['key']}")
        if MODULE.match(code) and not _module_exists(code) and not _is_attribute(code):
            problems.append(f"`{code}`: no such module or attribute")
        if not FLAG.match(code) and " " not in code.strip():
            if (problem := path_problem(code, page)) is not None:
                problems.append(f"`{code}`: {problem}")
        return problems


_SOURCE_TEXT: list[str] = []


def message_problems(cell: str) -> list[str]:
    """The pieces of an error line a troubleshooting table quotes (its first cell's code, split at
    ``...``) must each appear in the code that prints it."""
    if not _SOURCE_TEXT:
        files = [*sorted((REPO / "megatron_ext").rglob("*.py")), REPO / "pretrain_encoder.py"]
        _SOURCE_TEXT.append("\n".join(path.read_text() for path in files))
    problems = []
    for match in INLINE_CODE.finditer(cell):
        for piece in (part.strip() for part in match["code"].split("...")):
            if piece and piece not in _SOURCE_TEXT[0]:
                problems.append(f"no error line of the code contains {piece!r} (quoted as `{match['code']}`)")
    if not INLINE_CODE.search(cell):
        problems.append("a row of an error-message table quotes no message in its first cell")
    return problems


def _outputs_under(value, root: Path):
    """``value`` (a loaded recipe) with every string under ``runs/`` put under ``root``."""
    if isinstance(value, dict):
        return {key: _outputs_under(item, root) for key, item in value.items()}
    if isinstance(value, list):
        return [_outputs_under(item, root) for item in value]
    if isinstance(value, str) and value.startswith(OUTPUTS):
        return str(root / value)
    return value


def recipe_problems(text: str) -> list[str]:
    """A whole recipe (a YAML block marked ``recipe``) must validate as ``pretrain_encoder.py``
    would read it, from the repository's root; the tokenizer is loaded (and must serve the run)
    when the vocabulary comes from it."""
    from megatron_ext.cli.pretrain_encoder import config_from_recipe
    from megatron_ext.config_loading import UserError
    from megatron_ext.training.preflight import check_tokenizer_serves

    saved_cwd = os.getcwd()
    try:
        os.chdir(REPO)
        config, tokenizer = config_from_recipe(yaml.safe_load(text))
        if tokenizer is not None:
            check_tokenizer_serves(config, tokenizer)
    except UserError as error:
        return [f"this recipe does not validate: {error}"]
    finally:
        os.chdir(saved_cwd)
    return []


def module_program(path: Path) -> str | None:
    """``benchmarks.x`` for a program of one of the checkout's packages that is run from the
    repository's root as ``python -m benchmarks.x``: every benchmark, and a tool that imports its
    own package (``tools/render_docs.py``). Run by its path, Python would put its folder on the path,
    not the root, and the package would not import. None for a program run by its path."""
    package = path.parent
    if path.suffix != ".py" or package.parent != REPO or not (package / "__init__.py").is_file():
        return None
    if package.name == "benchmarks" or re.search(rf"^\s*(from|import) {package.name}\b", path.read_text(), re.M):
        return f"{package.name}.{path.stem}"
    return None


def _module_exists(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ImportError:  # a parent is a module, not a package
        return False


def _is_attribute(dotted: str) -> bool:
    module, _, name = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _has_help(program: Program) -> bool:
    try:
        program_help(program)
        return True
    except RuntimeError:
        return False


def link_problem(target: str, page: Path) -> str | None:
    if re.match(r"^[a-z]+:", target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    resolved = (page.parent / path_part).resolve() if path_part else page.resolve()
    if not resolved.exists():
        return f"link to a missing file: {target}"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"link to a missing heading: {target} (no '#{anchor}' in {_rel(resolved)})"
    return None


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def doc_pages() -> list[Path]:
    """The pages checked: the README and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_docs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to check (default: README.md and docs/)")
    parser.add_argument("--no-run", action="store_true", help="check the commands without running any")
    parser.add_argument("--stand-in", action="append", default=[], metavar="PATH=REAL",
                        help="run the pages' commands with REAL where they name PATH (a model of the reader's, "
                             "e.g. runs/demo/checkpoints=DIR); repeatable")
    args = parser.parse_args(argv)
    if malformed := [item for item in args.stand_in if "=" not in item]:
        parser.error(f"--stand-in: expected PATH=REAL, got {malformed[0]!r}")
    stand_ins = dict(item.split("=", 1) for item in args.stand_in)
    pages = [p.resolve() for p in args.pages] or doc_pages()
    with tempfile.TemporaryDirectory(prefix="check_docs-") as scratch:
        checker = DocsChecker(run=not args.no_run, scratch=Path(scratch), stand_ins=stand_ins)
        problems = checker.check_pages(pages)
    for problem in problems:
        print(problem)
    print(f"{len(pages)} pages, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
