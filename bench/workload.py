"""What the benchmark sends: seeded synthetic prompts of chosen lengths, or a user's JSONL.

Synthetic prompts are random sequences of common English words that SmolLM2's BPE (and
GPT-2-style BPEs generally) encode as one token each, so a prompt of N words reaches the
server as N prompt tokens (plus the chat template's own tokens on the chat endpoint; about
30 for SmolLM2's default system prompt). The server's `usage.prompt_tokens` is the measured
truth; the target length is kept beside it. Random words also keep prompts from sharing
prefixes, so prefix caching does not flatter the numbers.

Length distributions (`parse_length`):
    "128"                    fixed
    "1000-2000"              uniform over the inclusive range
    "normal(300,50)"         normal, clipped to [max(1, mean-3*std), mean+3*std]
    "normal(300,50,100,400)" normal, clipped to [100, 400]
A mix of request classes (`parse_mix`): "NAME:WEIGHT:INPUT:OUTPUT", e.g.
"long:1:1000-2000:128" together with "chat:4:16-128:16-64".

Synthetic request i depends only on (seed, i): a run of 10 requests is the first 10 of a
run of 100 with the same seed.
"""
from __future__ import annotations

import json
import math
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pdserve.common.errors import PdserveError


class BenchConfigError(PdserveError, ValueError):
    """A benchmark setting is malformed: a length or mix spec, a dataset line, a flag value."""


# Each word, with and without a leading space, is exactly one token in SmolLM2's
# tokenizer (checked against its vocabulary): N words joined by spaces -> N tokens.
WORDS: tuple[str, ...] = tuple("""
the of and to in is it you that he was for on are with as his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said
an each she which do their time if will way about many then them write would like so these
her long make thing see him two has look more day could go come did number sound no most
people my over know water than call first who may down side been now find any new work part
take get place made live where after back little only round man year came show every good me
give our under name very through just form sentence great think say help low line turn cause
much mean before move right boy old too same tell does set three want air well also play
small end put home read hand port large add even land here must big high such follow act why
ask men change went light kind off need house picture try us again animal point mother world
near build self earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought
city tree cross farm hard start might story far sea draw left late run while press close
night real life few north open together next white children begin got walk example paper
group always music those both mark often letter until mile river car feet care second book
science eat room friend idea fish stop once base horse cut watch color face wood main enough
plain girl usual young ready above ever red list though feel talk bird soon body dog family
direct pose leave song measure door product black short class wind question complete ship
area half rock order fire south problem piece pass since top whole king space best hour
better true during hundred five remember step early hold west ground interest reach fast
verb sing listen six table travel less ten simple several war lay against pattern slow
center love person money road map rain rule govern pull cold voice unit power town fine
certain fly fall lead dark machine note wait plan figure star box noun field rest correct
able pound done drive stood front week final green oh quick develop ocean warm free minute
strong special mind clear tail fact street inch multiply nothing course stay wheel full
force blue object surface deep moon foot system test record boat common gold possible plane
stead dry ago ran check game shape miss heat snow yes fill east language among
""".split())

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of token counts; every sample lies in [low, high], low >= 1."""

    kind: str  # "fixed" | "uniform" | "normal"
    low: int
    high: int
    mean: float = 0.0
    std: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return min(self.high, max(self.low, round(rng.gauss(self.mean, self.std))))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"{self.low}-{self.high}"
        return f"normal({self.mean:g},{self.std:g},{self.low},{self.high})"


_NUM = r"\s*(\d+(?:\.\d*)?)\s*"
_NORMAL = re.compile(rf"normal\({_NUM},{_NUM}(?:,{_NUM},{_NUM})?\)$")


def parse_length(spec: str) -> LengthDist:
    """Parse "128", "1000-2000" or "normal(mean,std[,low,high])" (see module docstring)."""
    text = spec.strip().lower()
    if re.fullmatch(r"\d+", text):
        n = int(text)
        if n < 1:
            raise BenchConfigError(f"length {spec!r}: must be >= 1")
        return LengthDist("fixed", n, n)
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
    if m:
        low, high = int(m.group(1)), int(m.group(2))
        if not 1 <= low <= high:
            raise BenchConfigError(f"length {spec!r}: need 1 <= low <= high")
        return LengthDist("uniform", low, high)
    m = _NORMAL.match(text)
    if m:
        mean, std = float(m.group(1)), float(m.group(2))
        if m.group(3) is None:
            low, high = max(1, math.floor(mean - 3 * std)), math.ceil(mean + 3 * std)
        else:
            low, high = int(float(m.group(3))), int(float(m.group(4)))
        if not 1 <= low <= high or not low <= mean <= high:
            raise BenchConfigError(f"length {spec!r}: need 1 <= low <= mean <= high")
        return LengthDist("normal", low, high, mean, std)
    raise BenchConfigError(
        f"length {spec!r}: expected N, LOW-HIGH or normal(MEAN,STD[,LOW,HIGH])")


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One kind of request in a mix, drawn with probability weight / sum(weights)."""

    name: str
    weight: float
    input_len: LengthDist
    output_len: LengthDist


def parse_mix(specs: Sequence[str]) -> tuple[RequestClass, ...]:
    """Parse "NAME:WEIGHT:INPUT:OUTPUT" entries into request classes."""
    classes = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 4:
            raise BenchConfigError(f"mix {spec!r}: expected NAME:WEIGHT:INPUT:OUTPUT")
        name, weight_text, input_spec, output_spec = (p.strip() for p in parts)
        try:
            weight = float(weight_text)
        except ValueError:
            raise BenchConfigError(f"mix {spec!r}: weight {weight_text!r} is not a number") from None
        if not name or not weight > 0 or math.isinf(weight):
            raise BenchConfigError(f"mix {spec!r}: need a name and a finite weight > 0")
        classes.append(RequestClass(name, weight, parse_length(input_spec), parse_length(output_spec)))
    if not classes:
        raise BenchConfigError("mix: no request classes")
    if len({c.name for c in classes}) != len(classes):
        raise BenchConfigError("mix: class names must be distinct")
    return tuple(classes)


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a run. `target_input_tokens` is None for dataset entries."""

    index: int
    class_name: str
    messages: tuple[Message, ...]
    max_tokens: int
    target_input_tokens: int | None

    def prompt_text(self) -> str:
        """The prompt for the completions endpoint: message contents joined by newlines."""
        return "\n".join(m.content for m in self.messages)


def synthetic_text(num_words: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=num_words))


class Workload(ABC):
    """The requests a benchmark sends, addressable by index.

    Contract: `requests(first, count)` returns requests with indices first..first+count-1,
    the same ones on every call (reproducible); different index ranges are the runs of a
    sweep, so a server's prefix cache cannot carry one run's prompts into the next (the
    synthetic workload; a dataset is cycled and does repeat).
    """

    @abstractmethod
    def requests(self, first_index: int, count: int) -> list[BenchRequest]: ...


@dataclass(frozen=True, slots=True)
class SyntheticWorkload(Workload):
    """Single-turn prompts of random words; request i depends only on (seed, i)."""

    classes: tuple[RequestClass, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.classes:
            raise BenchConfigError("synthetic workload: no request classes")

    def requests(self, first_index: int, count: int) -> list[BenchRequest]:
        return [self._request(i) for i in range(first_index, first_index + max(0, count))]

    def _request(self, index: int) -> BenchRequest:
        rng = random.Random(f"pdserve-bench:{self.seed}:{index}")  # str seeds hash deterministically
        cls = rng.choices(self.classes, [c.weight for c in self.classes])[0]
        num_input = cls.input_len.sample(rng)
        max_tokens = cls.output_len.sample(rng)
        text = synthetic_text(num_input, rng)
        return BenchRequest(index, cls.name, (Message("user", text),), max_tokens, num_input)


NAMES = ("Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Joana")
PLACES = ("Lisbon", "Osaka", "Nairobi", "Lima", "Oslo", "Perth", "Quito", "Riga", "Tunis", "Hanoi")


def _sentences(num_words: int, rng: random.Random) -> str:
    """Plain sentences of about `num_words` words: who did what with which thing, where."""
    out: list[str] = []
    words = 0
    while words < num_words:
        thing = " ".join(rng.choices(WORDS, k=2))
        sentence = f"{rng.choice(NAMES)} took the {thing} to {rng.choice(PLACES)} on day {rng.randint(1, 28)}."
        out.append(sentence)
        words += len(sentence.split())
    return " ".join(out)


def _code(num_words: int, rng: random.Random) -> tuple[str, str]:
    """A Python function of about `num_words` words, and one of its variables."""
    names = rng.sample(WORDS, 8)
    variable = f"{names[0]}_{names[1]}"
    lines = [f"def {names[2]}_{names[3]}(items, limit):", f"    {variable} = 0"]
    while sum(len(line.split()) for line in lines) < num_words:
        a, b = rng.sample(names[4:], 2)
        lines += [f"    for {a} in items:", f"        if {a}.{b} > limit:", f"            {variable} += {a}.{b}",
                  f"        {variable} = min({variable}, limit * {rng.randint(2, 9)})"]
    lines.append(f"    return {variable}")
    return "\n".join(lines) + "\n", variable


@dataclass(frozen=True, slots=True)
class CopyWorkload(Workload):
    """Requests whose answers quote their prompts, the work prompt-lookup speculation is
    for: repeat a text, list the sentences of a text that name someone, rename a variable in
    a function. Request i depends only on (seed, i); the kinds take turns."""

    input_len: LengthDist
    output_len: LengthDist
    seed: int = 0

    def requests(self, first_index: int, count: int) -> list[BenchRequest]:
        return [self._request(i) for i in range(first_index, first_index + max(0, count))]

    def _request(self, index: int) -> BenchRequest:
        rng = random.Random(f"pdserve-bench-copy:{self.seed}:{index}")
        num_words = self.input_len.sample(rng)
        max_tokens = self.output_len.sample(rng)
        kind = ("repeat", "extract", "rename")[index % 3]
        if kind == "rename":
            code, variable = _code(num_words, rng)
            text = (f"Rename the variable {variable} to total in this Python function. Answer with the "
                    f"whole function only.\n\n```python\n{code}```")
        elif kind == "extract":
            text = (f"Copy every sentence of this text that names {rng.choice(NAMES)}, word for word, one per "
                    f"line.\n\n{_sentences(num_words, rng)}")
        else:
            text = f"Repeat the following text exactly, word for word.\n\n{_sentences(num_words, rng)}"
        return BenchRequest(index, kind, (Message("user", text),), max_tokens, None)


@dataclass(frozen=True, slots=True)
class DatasetWorkload(Workload):
    """Conversations from a user's file, cycled in file order."""

    rows: tuple[tuple[tuple[Message, ...], int], ...]  # (messages, max_tokens) per line

    def __post_init__(self) -> None:
        if not self.rows:
            raise BenchConfigError("dataset workload: no requests")

    def requests(self, first_index: int, count: int) -> list[BenchRequest]:
        n = len(self.rows)
        return [BenchRequest(i, "dataset", *self.rows[i % n], target_input_tokens=None)
                for i in range(first_index, first_index + max(0, count))]


def _parse_dataset_line(where: str, line: str,
                        default_max_tokens: int) -> tuple[tuple[Message, ...], int]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise BenchConfigError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise BenchConfigError(f"{where}: expected an object")
    if "messages" in row:
        raw = row["messages"]
        if not isinstance(raw, list) or not raw:
            raise BenchConfigError(f"{where}: 'messages' must be a non-empty list")
        messages = []
        for m in raw:
            if (not isinstance(m, dict) or m.get("role") not in ROLES
                    or not isinstance(m.get("content"), str)):
                raise BenchConfigError(f"{where}: each message needs a role in {ROLES} and string content")
            messages.append(Message(m["role"], m["content"]))
    elif isinstance(row.get("prompt"), str):
        messages = [Message("user", row["prompt"])]
    else:
        raise BenchConfigError(f"{where}: needs 'messages' (a list) or 'prompt' (a string)")
    max_tokens = row.get("max_tokens", default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BenchConfigError(f"{where}: 'max_tokens' must be an integer >= 1")
    return tuple(messages), max_tokens


def load_dataset(path: str | Path, default_max_tokens: int) -> DatasetWorkload:
    """Read a JSONL file, one `{"messages": [...], "max_tokens": N}` (or `{"prompt": "..."}`)
    per line; blank lines are skipped; a line without max_tokens gets `default_max_tokens`."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchConfigError(f"dataset {path}: {e}") from None
    rows = tuple(_parse_dataset_line(f"{path}:{n}", line, default_max_tokens)
                 for n, line in enumerate(lines, 1) if line.strip())
    if not rows:
        raise BenchConfigError(f"dataset {path}: no requests")
    return DatasetWorkload(rows)
