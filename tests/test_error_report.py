"""recipes/error_analysis.py (which utterances a model got wrong, and how) and the entry
point recipes/error_report.py that prints a run's report."""

from __future__ import annotations

import random

from data.text import DIGIT_WORDS
from recipes.error_analysis import (
    MISSING,
    Outcome,
    confusions,
    error_report,
    find_collapse,
    word_confusions,
)


def test_word_confusions_pair_substitutions_and_mark_missing_or_extra_words() -> None:
    assert word_confusions("two", "two") == []
    assert word_confusions("two", "four") == [("two", "four")]
    assert word_confusions("one two three", "one three") == [("two", MISSING)]
    assert word_confusions("one three", "one two three") == [(MISSING, "two")]
    assert word_confusions("six", "") == [("six", MISSING)]
    assert word_confusions("one two", "nine eight seven") == [
        ("one", "nine"),
        ("two", "eight"),
        (MISSING, "seven"),
    ]


OUTCOMES = [
    Outcome("2_george_0", "george", "two", "four"),
    Outcome("2_george_1", "george", "two", "four"),
    Outcome("2_george_2", "george", "two", "two"),
    Outcome("8_lucas_0", "lucas", "eight", "six"),
    Outcome("2_lucas_0", "lucas", "two", "four"),
    Outcome("5_theo_0", "theo", "five", "five"),
    Outcome("6_theo_0", "theo", "six", ""),
]


def test_confusions_count_per_speaker_over_wrong_utterances_only() -> None:
    counts = confusions(OUTCOMES, words=True)
    assert counts[("two", "four", "george")] == 2
    assert counts[("two", "four", "lucas")] == 1
    assert counts[("six", MISSING, "theo")] == 1
    assert ("two", "two", "george") not in counts
    assert sum(counts.values()) == 5


def test_error_report_gives_totals_speakers_confusions_and_the_wrong_utterances() -> None:
    report = error_report(OUTCOMES, words=True, title="Test errors")
    lines = report.splitlines()
    assert lines[0] == "# Test errors"
    assert "5 of 7 utterances wrong (71.43 %)." in lines
    assert "| george | 3 | 2 | 66.67 |" in lines
    assert "| theo | 2 | 1 | 50.00 |" in lines
    # The most frequent confusion first, with the speakers it comes from.
    table = lines.index("| reference | prediction | count | from speakers |")
    assert lines[table + 2] == "| two | four | 3 | george 2, lucas 1 |"
    assert f"| six | {MISSING} | 1 | theo 1 |" in lines
    assert f"| 6_theo_0 | theo | six | {MISSING} |" in lines
    assert not any(line.startswith("| 5_theo_0") for line in lines)  # right: not listed


def test_speaker_id_confusions_are_whole_labels_and_listing_is_capped() -> None:
    """A speaker-ID report spoke ASR: "∅: missing or extra" (a label is never missing),
    a "from speakers" column that repeated the reference, and a wrong utterance's speaker
    twice (as its speaker and its reference). Found by audit-speaker."""
    outcomes = [Outcome(f"u{i}", "jackson", "jackson", "nicolas") for i in range(5)]
    report = error_report(outcomes, words=False, max_listed=2)
    lines = report.splitlines()
    table = lines.index("| speaker | identified as | count |")
    assert lines[table - 2] == "## Most frequent confusions (speakers)"
    assert lines[table + 2] == "| jackson | nicolas | 5 |"
    assert "## Wrong utterances (2 of 5 listed)" in lines
    assert "| id | speaker | identified as |" in lines and "| u0 | jackson | nicolas |" in lines
    assert MISSING not in report and "from speakers" not in report


def test_a_perfect_test_reports_no_confusions() -> None:
    report = error_report([Outcome("a", "s", "one", "one")], words=True)
    assert "0 of 1 utterances wrong (0.00 %)." in report
    assert "| — | — | 0 | — |" in report


def connected_digits(predict, n: int = 60, seed: int = 0) -> list[Outcome]:
    """``n`` outcomes of 2-7 random digit words each; ``predict(reference)`` is the model."""
    rng = random.Random(seed)
    outcomes = []
    for i in range(n):
        reference = " ".join(rng.choice(DIGIT_WORDS) for _ in range(rng.randint(2, 7)))
        outcomes.append(Outcome(f"u{i}", f"s{i % 6}", reference, predict(reference)))
    return outcomes


def test_a_model_that_says_five_to_everything_is_flagged_as_collapsed() -> None:
    """What Conformer-M wrote on the H200 with too large batches (CER 64 %)."""
    outcomes = connected_digits(lambda ref: "five five" if len(ref) % 2 else "five")
    collapse = find_collapse(outcomes, words=True)
    assert collapse is not None and collapse.label == "five"
    assert collapse.share == 1.0 and 0.0 < collapse.reference_share < 0.2
    report = error_report(outcomes, words=True)
    assert f"**Collapsed.** {collapse.message()}" in report.splitlines()
    assert '"five" for 100 %' in collapse.message() and "prior" in collapse.message()


def test_empty_transcripts_and_one_speaker_for_all_are_collapses_too() -> None:
    blank = find_collapse(connected_digits(lambda ref: ""), words=True)
    assert blank is not None and blank.label == MISSING and blank.reference_share == 0.0
    speakers = [Outcome(f"u{i}", "x", f"s{i % 6}", "s2") for i in range(30)]
    one = find_collapse(speakers, words=False)
    assert one is not None and one.label == "s2" and round(one.reference_share, 3) == 0.167


def test_a_model_that_listens_is_not_flagged_even_when_it_errs_often() -> None:
    def sloppy(ref: str) -> str:  # every other word wrong, the errors spread over digits
        words = ref.split()
        return " ".join(
            w if k % 2 else DIGIT_WORDS[(k + len(ref)) % 10] for k, w in enumerate(words)
        )

    outcomes = connected_digits(sloppy)
    assert sum(not o.correct for o in outcomes) > 30
    assert find_collapse(outcomes, words=True) is None
    assert "Collapsed" not in error_report(outcomes, words=True)
    few = [Outcome(f"u{i}", "s", word, "two") for i, word in enumerate(DIGIT_WORDS[3:8])]
    assert find_collapse(few, words=True) is None  # 5 outputs: too few to tell


def test_saying_what_most_references_say_is_not_a_collapse() -> None:
    """A test set that is mostly one word, answered with that word, is a right answer."""
    outcomes = [Outcome(f"u{i}", "s", "two", "two") for i in range(25)]
    outcomes += [Outcome(f"v{i}", "s", "six", "two") for i in range(5)]
    assert find_collapse(outcomes, words=True) is None


def test_the_report_lists_every_wrong_utterance_by_default() -> None:
    """docs/run_outputs.md promises every wrong utterance in test_errors.md; it listed the
    first 200, so a test with more errors (the 1000-utterance connected-digit test of a
    collapsed run: 999) could not be checked utterance by utterance against its figures."""
    outcomes = connected_digits(lambda reference: "five", n=250)
    wrong = [o for o in outcomes if not o.correct]
    report = error_report(outcomes, words=True)
    assert f"## Wrong utterances ({len(wrong)} of {len(wrong)} listed)" in report
    listed = {line.split(" | ")[0].lstrip("| ") for line in report.splitlines()[-len(wrong) :]}
    assert listed == {o.id for o in wrong}


def test_error_report_py_prints_a_runs_report_or_the_command_that_makes_it(
    tmp_path, capsys, fsdd_root
) -> None:
    """``python recipes/error_report.py RUN`` did nothing and exited 0 (no entry point)."""
    from recipes.error_analysis import TEST_ERRORS_FILE
    from recipes.error_report import main
    from tests.recipe_helpers import run_cli

    finished, unfinished = tmp_path / "finished", tmp_path / "unfinished"
    for run in (finished, unfinished):
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text("{}\n")
        (run / "labels.json").write_text("{}\n")
    report = error_report([Outcome("u1", "theo", "two", "four")], words=True, title="Test errors")
    (finished / TEST_ERRORS_FILE).write_text(report)
    result = run_cli("error_report.py", [str(finished)], fsdd_root, timeout=120)
    assert result.returncode == 0 and result.stdout == report, result.stderr[-2000:]
    assert main([str(unfinished)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {unfinished} has no {TEST_ERRORS_FILE}") and err.count("\n") == 1
    assert f"Fix: python recipes/evaluate.py {unfinished} --errors errors.md" in err
