"""A small Dockerfile reader for the structural tests: instructions grouped by build stage."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str
    """Upper-cased instruction name (FROM, RUN, COPY, ...)."""
    text: str
    """Everything after the keyword, continuation lines joined."""

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form ENTRYPOINT/CMD/HEALTHCHECK CMD."""
        start = self.text.index("[")
        parsed = json.loads(self.text[start:])
        assert isinstance(parsed, list)
        return [str(item) for item in parsed]


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert len(found) == 1, f"expected one {keyword} in stage {self.name}, found {len(found)}"
        return found[0]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for token in shlex.split(instruction.text):
                key, _, value = token.partition("=")
                values[key] = value
        return values


@dataclass
class Dockerfile:
    args: dict[str, str]
    """Global ARGs (before the first FROM) and their defaults."""
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def parse(path: Path) -> Dockerfile:
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, text = line.partition(" ")
        instruction = Instruction(keyword.upper(), text.strip())
        if instruction.keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", instruction.text, re.IGNORECASE)
            assert match, line
            stages.append(Stage(base=match[1], name=match[2]))
        elif not stages and instruction.keyword == "ARG":
            key, _, value = instruction.text.partition("=")
            args[key] = value
        else:
            stages[-1].instructions.append(instruction)
    return Dockerfile(args, stages)
