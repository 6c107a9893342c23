"""RULER's synthetic tasks (NVIDIA/RULER, `scripts/data/synthetic`), as pure functions of
(tokenizer, task, length, sample index): the prompts of `eval ruler`.

The definitions are RULER's; the code is this project's, and nothing is downloaded:

- needle in a haystack (`niah_*`): "One of the special magic {numbers} for {key} is:
  {value}." sentences hidden in a haystack, then asked for by key. Keys are adjective-noun
  words, values 7-digit numbers or UUIDs. single (1 key, 1 value), multikey (distractor
  keys; `niah_multikey_2/3`: the haystack is itself made of distractor needles),
  multivalue (4 values of one key), multiquery (4 keys asked at once);
- variable tracking (`vt`): a chain "VAR A = 12345", "VAR B = VAR A", ... (4 hops) hidden
  in the haystack, after one worked example; every variable holding the value is asked for;
- common-word extraction (`cwe`): a numbered list where 10 words repeat more often than the
  others (6 against 1 below 4k tokens, 30 against 3 from 4k, as RULER), after one worked
  example; the 10 are asked for;
- frequent-word extraction (`fwe`): 6-letter coded words with Zipf counts (alpha 2, the
  most frequent one replaced by "..."), the three most frequent after "..." asked for.

Haystacks: RULER's "noise" (five sentences repeated) and, for RULER's "essay" (Paul
Graham's essays), CPython's own `pydoc_data.topics` (the same text `eval ppl` reads; it
ships with Python, so its exact words follow the Python version). Words: keys from two
fixed lists below, cwe's words from the pydoc text's vocabulary.

Every prompt is split where RULER's template puts `{context}`'s end: `Sample.context` is
the instruction and the haystack (what a cache compresses before any question),
`Sample.question` the question and RULER's answer prefix, tokenized so that
`context + question` is the whole prompt's tokenization. The prompt and its
`tokens_to_generate` fit the target length together (RULER's budget: the haystack is the
largest that fits, found by bisection).

Scoring is RULER's (`scripts/eval/synthetic/constants.py`): `string_match_all` (the share
of references found in the prediction, case-insensitive, in percent; every synthetic task)
and `string_match_part` (any reference found; RULER's QA tasks).

Example:
    >>> string_match_all(["The numbers are 1234 and 77."], [["1234", "5678"]])
    50.0
    >>> string_match_part(["The numbers are 1234 and 77."], [["1234", "5678"]])
    100.0
    >>> TASKS["niah_single_2"].haystack, TASKS["niah_multivalue"].num_v
    ('essay', 4)
"""

import math
import random
import re
import string
import uuid
from functools import lru_cache
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACKS = ("noise", "essay")  # the filler haystacks; "needle" (distractor needles) is a task's own
TEMPLATES = ("base", "chat")  # RULER's "base" template, or the tokenizer's chat template around it

# ---------------------------------------------------------------- RULER's templates, split
# (RULER's scripts/data/synthetic/constants.py; the context part ends where `{context}` does)

NIAH_CONTEXT = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the {type_v} afterwards.\n{context}")
NIAH_QUESTION = "\nWhat are all the special magic {type_v} for {query} mentioned in the provided text?"
NIAH_ANSWER = " The special magic {type_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."

VT_CONTEXT = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {query} in the text above."
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
             "are assigned the value {query}, they are: ")

CWE_CONTEXT = ("Below is a numbered list of words. In these words, some appear more often than others. "
               "Memorize the ones that appear most often.\n{context}")
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"

FWE_CONTEXT = ("Read the following coded text and track the frequency of each coded word. Find the three most "
               "frequently appeared coded words. {context}")
FWE_QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three "
                "most frequently appeared words in the above coded text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"


class Task(NamedTuple):
    """One of RULER's synthetic tasks (scripts/synthetic.yaml): its family, haystack, the
    needles' kinds and counts, and RULER's `tokens_to_generate`."""

    family: str  # "niah", "vt", "cwe", "fwe"
    haystack: Optional[str] = None  # "noise", "essay", "needle" (niah's distractor needles) or None
    type_k: str = "words"
    type_v: str = "numbers"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    tokens_to_generate: int = 128
    one_line: bool = True  # the answer ends with its line (one answer, or RULER's worked examples answer on
    # one line); False: lists a model may write one item a line (fwe, multivalue, multiquery)


TASKS: Dict[str, Task] = {
    "niah_single_1": Task("niah", "noise"),
    "niah_single_2": Task("niah", "essay"),
    "niah_single_3": Task("niah", "essay", type_v="uuids"),
    "niah_multikey_1": Task("niah", "essay", num_k=4),
    "niah_multikey_2": Task("niah", "needle"),
    "niah_multikey_3": Task("niah", "needle", type_k="uuids", type_v="uuids"),
    "niah_multivalue": Task("niah", "essay", num_v=4, one_line=False),
    "niah_multiquery": Task("niah", "essay", num_q=4, num_k=4, one_line=False),
    "vt": Task("vt", "noise", num_v=5, tokens_to_generate=30),
    "cwe": Task("cwe", tokens_to_generate=120),
    "fwe": Task("fwe", tokens_to_generate=50, one_line=False),
}


class Sample(NamedTuple):
    """One prompt: `context` (ids: instruction, examples and haystack), `question` (ids:
    the question and RULER's answer prefix), the `answers` a prediction is scored against,
    and the task's `max_tokens` (RULER's tokens_to_generate). `text` is the whole prompt."""

    task: str
    haystack: Optional[str]
    length: int
    index: int
    context: List[int]
    question: List[int]
    answers: List[str]
    max_tokens: int
    one_line: bool
    text: str

    @property
    def prompt(self) -> List[int]:
        """The whole prompt, `context + question` (the query-aware protocol's)."""
        return self.context + self.question


# ---------------------------------------------------------------- scoring (RULER's metrics)


def postprocess(prediction: str) -> str:
    """RULER's `postprocess_pred`: strip, and every control character becomes a newline."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Percent: per prediction, the share of its references it contains (lowercased), averaged."""
    _same_count(predictions, references)
    score = sum(sum(r.lower() in p.lower() for r in refs) / len(refs) for p, refs in zip(predictions, references))
    return round(score / len(predictions) * 100, 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Percent: per prediction, 100 when it contains any of its references (lowercased), averaged."""
    _same_count(predictions, references)
    score = sum(max(r.lower() in p.lower() for r in refs) for p, refs in zip(predictions, references))
    return round(score / len(predictions) * 100, 2)


def _same_count(predictions, references) -> None:
    if not predictions or len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions and {len(references)} reference lists: expected the "
                         "same number, at least one")
    if any(not refs for refs in references):
        raise ValueError("a reference list is empty: expected at least one reference per prediction")


METRICS: Dict[str, Callable] = {"niah": string_match_all, "vt": string_match_all, "cwe": string_match_all,
                                "fwe": string_match_all}


def found_all(prediction: str, answers: Sequence[str]) -> bool:
    """Every answer is in the prediction already: more text cannot change its score."""
    return all(a.lower() in prediction.lower() for a in answers)


# ---------------------------------------------------------------- words and haystacks

ADJECTIVES = ("amber", "ancient", "bitter", "brave", "bright", "calm", "clever", "cold", "crimson", "curious",
              "damp", "dark", "eager", "early", "fancy", "fierce", "gentle", "giant", "golden", "grumpy",
              "hollow", "honest", "humble", "icy", "jolly", "kind", "lively", "lonely", "loud", "lucky",
              "mellow", "misty", "noble", "odd", "pale", "polite", "proud", "quiet", "rapid", "rough",
              "rusty", "shiny", "silent", "silver", "sleepy", "smooth", "steady", "sturdy", "swift", "tame",
              "tender", "tiny", "vivid", "warm", "wild", "windy", "wise", "witty", "young", "zesty")
NOUNS = ("anchor", "apple", "badger", "barn", "beacon", "bicycle", "blanket", "bottle", "bridge", "cactus",
         "candle", "canyon", "castle", "cherry", "compass", "cottage", "crayon", "dolphin", "drum", "eagle",
         "engine", "falcon", "feather", "forest", "garden", "glacier", "guitar", "hammer", "harbor", "helmet",
         "island", "jacket", "kettle", "ladder", "lantern", "lemon", "meadow", "mirror", "monkey", "needle",
         "orchard", "otter", "painter", "parrot", "pebble", "pepper", "pillow", "planet", "pumpkin", "rabbit",
         "river", "saddle", "sailor", "shovel", "spider", "tiger", "tractor", "trumpet", "violin", "walrus")
KEY_WORDS = tuple(f"{a}-{n}" for a in ADJECTIVES for n in NOUNS)  # RULER: wonderwords' adjective-noun pairs


@lru_cache(maxsize=1)
def essay_words() -> Tuple[str, ...]:
    """RULER's essay haystack as words: CPython's pydoc topics (sorted by name, joined by
    blank lines, as `metrics.corpus_tokens` reads them), whitespace collapsed."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


@lru_cache(maxsize=1)
def vocabulary() -> Tuple[str, ...]:
    """cwe's words: the pydoc text's words (punctuation around them stripped) that are 4-10
    lowercase letters and occur at least twice, sorted (about 1,600)."""
    counts: Dict[str, int] = {}
    for word in essay_words():
        word = word.strip(".,;:!?()\"'")
        if re.fullmatch(r"[a-z]{4,10}", word):
            counts[word] = counts.get(word, 0) + 1
    return tuple(sorted(w for w, c in counts.items() if c >= 2))


def sentences(words: Sequence[str]) -> List[str]:
    """`words` joined and split after . ! or ? (RULER uses nltk's sent_tokenize)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(words)) if s]


DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 insertion depths, percent


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        return rng.choice(KEY_WORDS)
    raise ValueError(f"needle kind {kind!r} is invalid: expected numbers, uuids or words")


def _in_essay(parts: Sequence[str], n: int, depths: Sequence[int]) -> str:
    """The first `n` essay words (repeated when the essay is shorter) with `parts` inserted
    between sentences at `depths` percent (sorted), joined by spaces."""
    words = essay_words()
    words = (words * (n // len(words) + 1))[:n]
    sents = sentences(words)
    cuts = [0] + sorted(int(len(sents) * d / 100) for d in depths) + [len(sents)]
    out = []
    for i in range(1, len(cuts)):
        out.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
        if i - 1 < len(parts):
            out.append(parts[i - 1])
    return " ".join(p for p in out if p)


def _in_lines(lines: Sequence[str], parts: Sequence[str], where: Sequence[float]) -> str:
    """`lines` with `parts`, in their order, inserted before lines int(u * len(lines)) for u
    in sorted `where`, joined by newlines (RULER's noise and needle haystacks)."""
    out = list(lines)
    for j, (u, part) in enumerate(zip(sorted(where), parts)):
        out.insert(int(u * len(lines)) + j, part)
    return "\n".join(out)


# ---------------------------------------------------------------- the task families
# Each builder draws its random parts once and returns `build(n) -> (context, question,
# answers)`, a prompt whose haystack grows with n, so that the largest n that fits is found
# by bisection with everything else fixed.


def _niah(task: Task, haystack: str, rng: random.Random, length: int):
    num_k = max(task.num_k, task.num_q)
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(_unique(rng, task.type_k, keys))
        values.append([_random_value(rng, task.type_v) for _ in range(task.num_v)])
        needles += [NIAH_NEEDLE.format(type_v=task.type_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), task.num_q)
    query = keys[asked[0]] if task.num_q == 1 else ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
    answers = [v for i in asked for v in values[i]]
    type_v = task.type_v
    context, question = NIAH_CONTEXT, NIAH_QUESTION + NIAH_ANSWER
    if task.num_q * task.num_v == 1:  # RULER's singular wording for one answer
        context, question = (t.replace("Some", "A").replace("are all", "is").replace("are", "is")
                             for t in (context, question))
        type_v = type_v[:-1]
    question = question.format(type_v=type_v, query=query)
    where = [rng.random() for _ in needles]
    depths = rng.sample(DEPTHS, len(needles))
    distractors = []
    if haystack == "needle":  # RULER's needle haystack: distractor needles with other keys
        for _ in range(length // 8 + 1):
            key = _unique(rng, task.type_k, keys)
            distractors.append(NIAH_NEEDLE.format(type_v=task.type_v, key=key, value=_random_value(rng, task.type_v)))

    def build(n: int):
        if haystack == "essay":
            text = _in_essay(needles, n, depths)
        else:
            lines = [NOISE] * n if haystack == "noise" else distractors[:n]
            text = _in_lines(lines, needles, where)
        return context.format(type_v=type_v, context=text), question, answers

    return build, (len(distractors) if haystack == "needle" else None)


def _unique(rng: random.Random, kind: str, taken: Sequence[str]) -> str:
    while True:
        key = _random_value(rng, kind)
        if key not in taken:
            return key


def _variables(rng: random.Random, count: int, letters: int) -> List[str]:
    names: List[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    return names


def _vt_chain(rng: random.Random, hops: int, letters: int) -> Tuple[List[str], List[str], str]:
    names = _variables(rng, hops + 1, letters)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
    return names, chain, value


def _vt_text(haystack: str, chain: List[str], n: int, where, depths) -> str:
    if haystack == "essay":
        return _in_essay([c + "." for c in chain], n, depths)
    return _in_lines([NOISE] * n, chain, where)


def _vt(task: Task, haystack: str, rng: random.Random, tokenizer, length: int):
    hops = task.num_v - 1
    # RULER's worked example: the task itself at 500 tokens (3-letter names), its answer after it
    ex_names, ex_chain, ex_value = _vt_chain(rng, hops, 3)
    ex_where, ex_depths = [rng.random() for _ in ex_chain], sorted(rng.sample(DEPTHS, len(ex_chain)))

    def example(n: int) -> str:
        return (VT_CONTEXT.format(context=_vt_text(haystack, ex_chain, n, ex_where, ex_depths))
                + (VT_QUESTION + VT_ANSWER).format(query=ex_value, num_v=task.num_v))

    n_ex = _largest(lambda n: len(tokenizer.encode(example(n))), 500, 1)
    shot = example(n_ex) + " " + " ".join(ex_names) + "\n"
    names, chain, value = _vt_chain(rng, hops, 5)
    where, depths = [rng.random() for _ in chain], sorted(rng.sample(DEPTHS, len(chain)))
    question = (VT_QUESTION + VT_ANSWER).format(query=value, num_v=task.num_v)

    def build(n: int):
        return shot + VT_CONTEXT.format(context=_vt_text(haystack, chain, n, where, depths)), question, names

    return build, None


def _cwe_list(words: Sequence[str], common: int, rare: int, rng: random.Random) -> Tuple[str, List[str]]:
    """RULER's `get_example`: the first 10 words `common` times, the rest `rare` times, shuffled
    and numbered."""
    listed = list(words[:10]) * common + list(words[10:]) * rare
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), list(words[:10])


def _cwe(task: Task, rng: random.Random, length: int):
    vocab = list(vocabulary())
    rng.shuffle(vocab)
    shot_rng, list_seed = random.Random(rng.random()), rng.random()
    # RULER: below 4096 tokens 6 against 1 with a 20-word example (3 against 1); else 30 against 3, 40 (10, 3)
    (ex_n, ex_c, ex_r), (common, rare) = ((20, 3, 1), (6, 1)) if length < 4096 else ((40, 10, 3), (30, 3))
    ex_words, vocab = vocab[:ex_n], vocab[ex_n:]
    ex_list, ex_answer = _cwe_list(ex_words, ex_c, ex_r, shot_rng)
    shot = (CWE_CONTEXT.format(context=ex_list) + CWE_QUESTION + CWE_ANSWER + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer)) + "\n")
    question = CWE_QUESTION + CWE_ANSWER

    def build(n: int):
        listed, answer = _cwe_list(vocab[: 10 + n], common, rare, random.Random(list_seed))
        return shot + CWE_CONTEXT.format(context=listed), question, answer

    return build, len(vocab) - 10


def _zeta(alpha: float, terms: int = 10000) -> float:
    """Riemann zeta(alpha) for alpha > 1 (scipy.special.zeta in RULER): a partial sum plus its
    Euler-Maclaurin tail, within 1e-12 for alpha >= 1.5."""
    head = math.fsum(k ** -alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms ** -alpha


def _fwe(task: Task, rng: random.Random, length: int, alpha: float = 2.0, letters: int = 6):
    size = max((length - task.tokens_to_generate) // 50, 4)  # RULER: vocab_size = max_seq_length // 50
    vocab: List[str] = []
    while len(vocab) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=letters))
        if word not in vocab:
            vocab.append(word)
    vocab[0] = "..."  # the most frequent word is noise
    zeta, shuffle_seed = _zeta(alpha), rng.random()
    question = FWE_QUESTION + FWE_ANSWER

    def build(n: int):
        words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -alpha / zeta))]
        random.Random(shuffle_seed).shuffle(words)
        return FWE_CONTEXT.format(context=" ".join(words)), question, vocab[1:4]

    return build, None


# ---------------------------------------------------------------- prompts


def _largest(size: Callable[[int], int], limit: int, low: int, high: Optional[int] = None) -> int:
    """The largest n >= low with size(n) <= limit (size grows with n), by bisection;
    ValueError when even `low` does not fit."""
    if size(low) > limit:
        raise ValueError(f"{size(low)} tokens at the smallest haystack: over the {limit} available")
    if high is None:
        high = 2 * low
        while size(high) <= limit:
            low, high = high, 2 * high
    elif size(high) <= limit:
        return high
    while high - low > 1:  # size(low) fits, size(high) does not
        mid = (low + high) // 2
        low, high = (mid, high) if size(mid) <= limit else (low, mid)
    return low


def chat_parts(tokenizer) -> Tuple[str, str]:
    """The text the tokenizer's chat template puts before and after a user message (with
    the generation prompt): RULER's model template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("template 'chat' needs a tokenizer with a chat template: this one has none "
                         "(use template 'base')")
    mark = "\x00RULER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                         tokenize=False)
    head, tail = text.split(mark)
    return head, tail


def task_haystack(task: str, haystack: Optional[str] = None) -> Optional[str]:
    """The haystack `task` is built on: RULER's own, or `haystack` ("noise" or "essay") where
    RULER's is a filler one (niah's distractor needles, cwe and fwe stay as they are)."""
    own = TASKS[task].haystack
    if haystack is not None and haystack not in HAYSTACKS:
        raise ValueError(f"haystack {haystack!r} is invalid: expected one of {HAYSTACKS} (or None: RULER's own)")
    return haystack if haystack is not None and own in HAYSTACKS else own


def generate(tokenizer, task: str, length: int, index: int = 0, haystack: Optional[str] = None,
             template: str = "base") -> Sample:
    """Sample `index` of `task` at `length` tokens (prompt plus RULER's tokens_to_generate).

    A pure function of its arguments (and the Python version's pydoc text): the random
    draws come from a generator seeded by (task, haystack, length, index).

    Args:
      tokenizer: what counts the tokens (`encode(text)`, `encode(text, add_special_tokens=False)`).
      task: a name of `TASKS`.
      length: the target length in tokens, as RULER's max_seq_length.
      index: which sample (a different seed each).
      haystack: None for RULER's own, or "noise"/"essay" instead of a task's filler haystack
        (`task_haystack`).
      template: "base" (RULER's task template as is) or "chat" (inside the tokenizer's chat
        template: the context part after its user header, the question before its
        assistant header and RULER's answer prefix after it).

    Example (shapes): `s.context` [~ length - max_tokens - len(question)] ids, `s.question`
    [~ 30] ids, `s.answers` ["4721049"] for niah_single_1.
    """
    if task not in TASKS:
        raise ValueError(f"task {task!r} is invalid: expected one of {list(TASKS)}")
    if template not in TEMPLATES:
        raise ValueError(f"template {template!r} is invalid: expected one of {TEMPLATES}")
    spec, where = TASKS[task], task_haystack(task, haystack)
    rng = random.Random(f"{task}/{where}/{length}/{index}")
    if spec.family == "niah":
        build, high = _niah(spec, where, rng, length)
    elif spec.family == "vt":
        build, high = _vt(spec, where, rng, tokenizer, length)
    elif spec.family == "cwe":
        build, high = _cwe(spec, rng, length)
    else:
        build, high = _fwe(spec, rng, length)
    head, tail = chat_parts(tokenizer) if template == "chat" else ("", "")
    answer_at = {"niah": NIAH_ANSWER, "vt": VT_ANSWER, "cwe": CWE_ANSWER, "fwe": FWE_ANSWER}[spec.family][:10]

    def texts(n: int) -> Tuple[str, str, List[str]]:
        context, question, answers = build(n)
        cut = question.rindex(answer_at)  # the chat template's assistant header goes before the answer prefix
        return head + context, question[:cut] + tail + question[cut:], answers

    def size(n: int) -> int:
        context, question, _ = texts(n)
        return len(tokenizer.encode(context + question)) + spec.tokens_to_generate

    try:
        n = _largest(size, length, 1, high)
    except ValueError as e:
        raise ValueError(f"{task} does not fit in length={length}: {e} (with RULER's tokens_to_generate="
                         f"{spec.tokens_to_generate}); expected a larger length") from None
    context, question, answers = texts(n)
    return Sample(task, where, length, index, tokenizer.encode(context),
                  tokenizer.encode(question, add_special_tokens=False), list(answers), spec.tokens_to_generate,
                  spec.one_line, context + question)
