"""recipes/error_report.py: which utterances a model got wrong, and how."""

from __future__ import annotations

from recipes.error_report import MISSING, Outcome, confusions, error_report, word_confusions


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
    outcomes = [Outcome(f"u{i}", "jackson", "jackson", "nicolas") for i in range(5)]
    report = error_report(outcomes, words=False, max_listed=2)
    assert "| jackson | nicolas | 5 | jackson 5 |" in report
    assert "## Wrong utterances (2 of 5 listed)" in report
    assert "labels" in report


def test_a_perfect_test_reports_no_confusions() -> None:
    report = error_report([Outcome("a", "s", "one", "one")], words=True)
    assert "0 of 1 utterances wrong (0.00 %)." in report
    assert "| — | — | 0 | — |" in report
