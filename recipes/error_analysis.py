"""What a model got wrong: the wrong utterances of a test and the confusions they share.

A CER or an accuracy says how often a model errs, not how. Speech models err in patterns:
one speaker's "two" heard as "four" every time, a digit dropped after another, a speaker
taken for one with a similar voice. ``error_report`` lists each wrong utterance and counts
the confusions over them, per speaker, so that such a pattern is read off in seconds:

    python recipes/evaluate.py outputs/fsdd_digits/conformer_ctc/... --errors errors.md

Training writes the same report for its test as ``test_errors.md`` in the run folder;
``python recipes/error_report.py RUN_DIR`` prints it (that entry point is
``recipes/error_report.py``; this module is what it, the training and ``evaluate.py`` use).
ASR confusions are word pairs from aligning each reference with its transcript
(``difflib``; a missing or extra word pairs with ``MISSING``); speaker-ID confusions are
(true speaker, predicted speaker) pairs.
"""

from __future__ import annotations

import difflib
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: Stands for the absent side of a deleted or inserted word.
MISSING = "∅"
#: Name of the report training writes into the run folder.
TEST_ERRORS_FILE = "test_errors.md"


@dataclass(frozen=True)
class Outcome:
    """One evaluated utterance: who said it, what it was, what the model said.

    Attributes:
        id: the utterance id.
        speaker: the speaker's name.
        reference: the true label (a transcript, or the true speaker for speaker ID).
        prediction: the model's label.
    """

    id: str
    speaker: str
    reference: str
    prediction: str

    @property
    def correct(self) -> bool:
        """Whether the model said exactly what the reference says."""
        return self.reference == self.prediction


@dataclass(frozen=True)
class Collapse:
    """A model that says (nearly) the same thing whatever it hears.

    Attributes:
        label: what it says: a word (ASR; ``MISSING`` for empty transcripts) or a label.
        share: fraction of everything the model said that is ``label``.
        reference_share: fraction of the references that is ``label``.
    """

    label: str
    share: float
    reference_share: float

    @property
    def said(self) -> str:
        """What the model said, for people: ``"five"``, or ``nothing`` (empty transcripts)."""
        return "nothing" if self.label == MISSING else f'"{self.label}"'

    def record(self) -> dict[str, Any]:
        """The collapse for ``results.json`` (read back by the sweep summary)."""
        return {**asdict(self), "said": self.said}

    def message(self) -> str:
        """One line for the log and the report: what was seen, what it means, what to try."""
        said = self.said + (" (an empty transcript)" if self.label == MISSING else "")
        return (
            f"The model said {said} for {100 * self.share:.0f} % of its outputs (the "
            f"references: {100 * self.reference_share:.0f} %): it has learned the labels' "
            "prior, not the audio (for CTC: the plateau before alignments form). Typical "
            "causes: too few optimizer steps for the model, batches too large for them "
            "(fewer, less noisy steps), or a learning rate that is off."
        )


#: A collapse: one output makes up at least this share of what the model said ...
COLLAPSE_SHARE = 0.5
#: ... and at least this many times its share of the references ...
COLLAPSE_RATIO = 3.0
#: ... over at least this many outputs.
COLLAPSE_MIN_OUTPUTS = 20


def _units(text: str, words: bool) -> list[str]:
    """What a transcript or label counts as: its words (an empty one: ``MISSING``)."""
    if not words:
        return [text or MISSING]
    return text.split() or [MISSING]


def find_collapse(outcomes: Sequence[Outcome], words: bool) -> Collapse | None:
    """The output a collapsed model keeps giving, or None for a model that listens.

    A model that has learned only the label prior (a CTC model on its plateau, a classifier
    that always picks one class) answers most utterances with the same word or label, or
    with nothing. That shows long before a metric explains it: e.g. Conformer-M trained on
    too large batches wrote "five" for nearly every digit (CER 64 %;
    benchmarks/results/2026-11-26-h200.md). Flagged when one output is at least
    ``COLLAPSE_SHARE`` of all outputs and ``COLLAPSE_RATIO`` times its share of the
    references, over at least ``COLLAPSE_MIN_OUTPUTS`` outputs.
    """
    said = Counter(u for o in outcomes for u in _units(o.prediction, words))
    total = sum(said.values())
    if total < COLLAPSE_MIN_OUTPUTS:
        return None
    label, count = said.most_common(1)[0]
    references = Counter(u for o in outcomes for u in _units(o.reference, words))
    share = count / total
    reference_share = references[label] / max(sum(references.values()), 1)
    if share < COLLAPSE_SHARE or share < COLLAPSE_RATIO * reference_share:
        return None
    return Collapse(label, share, reference_share)


def word_confusions(reference: str, prediction: str) -> list[tuple[str, str]]:
    """(reference word, predicted word) for each word the two transcripts disagree on.

    The transcripts are aligned word by word; a substituted stretch pairs its words in
    order, and a word without a counterpart pairs with ``MISSING``.
    """
    ref, hyp = reference.split(), prediction.split()
    pairs: list[tuple[str, str]] = []
    matcher = difflib.SequenceMatcher(a=ref, b=hyp, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        ref_words, hyp_words = ref[i1:i2], hyp[j1:j2]
        for k in range(max(len(ref_words), len(hyp_words))):
            pairs.append(
                (
                    ref_words[k] if k < len(ref_words) else MISSING,
                    hyp_words[k] if k < len(hyp_words) else MISSING,
                )
            )
    return pairs


def confusions(outcomes: Sequence[Outcome], words: bool) -> Counter[tuple[str, str, str]]:
    """Counts of (reference, prediction, speaker) over the wrong ``outcomes``.

    ``words``: count aligned word pairs (ASR); otherwise whole labels (speaker ID).
    """
    counts: Counter[tuple[str, str, str]] = Counter()
    for outcome in outcomes:
        if outcome.correct:
            continue
        pairs = (
            word_confusions(outcome.reference, outcome.prediction)
            if words
            else [(outcome.reference, outcome.prediction)]
        )
        for ref, hyp in pairs:
            counts[(ref, hyp, outcome.speaker)] += 1
    return counts


def _cell(text: str) -> str:
    """``text`` as a markdown table cell (empty transcripts shown as MISSING)."""
    return text.replace("|", "\\|") if text else MISSING


def error_report(
    outcomes: Sequence[Outcome],
    words: bool,
    title: str = "Errors",
    max_confusions: int = 20,
    max_listed: int | None = None,
) -> str:
    """A markdown report of ``outcomes``: totals, errors per speaker, the most frequent
    confusions (with the speakers they come from) and the wrong utterances.

    Args:
        outcomes: every evaluated utterance, right and wrong.
        words: ASR (confusions are aligned word pairs) or not (whole labels).
        title: the report's heading.
        max_confusions: rows of the confusion table.
        max_listed: wrong utterances listed (all are counted); None: every one, so that
            the report with the test manifest gives the test's figures (CER, WER,
            accuracy) utterance by utterance.
    """
    wrong = [o for o in outcomes if not o.correct]
    listed = len(wrong) if max_listed is None else min(len(wrong), max_listed)
    share = 100.0 * len(wrong) / max(len(outcomes), 1)
    lines = [f"# {title}", "", f"{len(wrong)} of {len(outcomes)} utterances wrong ({share:.2f} %)."]
    collapse = find_collapse(outcomes, words)
    if collapse is not None:
        lines += ["", f"**Collapsed.** {collapse.message()}"]

    per_speaker: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        per_speaker[outcome.speaker].append(outcome)
    lines += [
        "",
        "## By speaker",
        "",
        "| speaker | utterances | wrong | wrong % |",
        "|---|---|---|---|",
    ]
    for speaker in sorted(per_speaker):
        said = per_speaker[speaker]
        bad = sum(not o.correct for o in said)
        lines.append(f"| {speaker} | {len(said)} | {bad} | {100.0 * bad / len(said):.2f} |")

    counts = confusions(outcomes, words)
    totals: Counter[tuple[str, str]] = Counter()
    speakers: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for (ref, hyp, speaker), count in counts.items():
        totals[(ref, hyp)] += count
        speakers[(ref, hyp)][speaker] += count
    # ASR: aligned word pairs, with the speakers who said them; speaker ID: a true speaker
    # and who the model took them for (the reference is the speaker: no column of its own)
    if words:
        heading = f"## Most frequent confusions (words; {MISSING}: missing or extra)"
        columns = ["reference", "prediction", "count", "from speakers"]
    else:
        heading, columns = (
            "## Most frequent confusions (speakers)",
            ["speaker", "identified as", "count"],
        )
    lines += ["", heading, "", _row(columns), _row(["---"] * len(columns)).replace(" ", "")]
    for (ref, hyp), count in sorted(totals.items(), key=lambda item: (-item[1], item[0]))[
        :max_confusions
    ]:
        by = ", ".join(f"{s} {n}" for s, n in speakers[(ref, hyp)].most_common())
        lines.append(_row([_cell(ref), _cell(hyp), str(count), by][: len(columns)]))
    if not totals:
        lines.append(_row(["—", "—", "0", "—"][: len(columns)]))

    columns = (
        ["id", "speaker", "reference", "prediction"]
        if words
        else ["id", "speaker", "identified as"]
    )
    lines += [
        "",
        f"## Wrong utterances ({listed} of {len(wrong)} listed)",
        "",
        _row(columns),
        _row(["---"] * len(columns)).replace(" ", ""),
    ]
    for outcome in sorted(wrong, key=lambda o: (o.speaker, o.id))[:listed]:
        cells = [outcome.id, outcome.speaker, _cell(outcome.reference), _cell(outcome.prediction)]
        lines.append(_row(cells if words else [*cells[:2], cells[3]]))
    return "\n".join(lines) + "\n"


def _row(cells: Sequence[str]) -> str:
    """A markdown table row: ``| a | b |``."""
    return "| " + " | ".join(cells) + " |"
