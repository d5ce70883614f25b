"""fix25 (a new user's trial): a WikiText article with no text under its heading was dropped in
silence (not counted in `documents`, not in `rejected`)."""

from __future__ import annotations

from oprag_client.loaders import load_wikitext, wikitext_articles

TEXT = (" = Kept = \n \n Some text . \n"
        " \n = Empty = \n \n"
        " \n = Kept = \n \n More text . \n"
        " \n = Empty = \n \n"
        " \n = Last = \n \n")


def test_an_empty_article_is_skipped_with_a_message_naming_title_and_line(tmp_path, capsys):
    f = tmp_path / "wiki.valid.tokens"
    f.write_text(TEXT, encoding="utf-8")
    docs = list(load_wikitext([f]))
    assert [d.id for d in docs] == ["wiki.valid:Kept", "wiki.valid:Kept (2)"]  # an empty one is no repeat
    assert capsys.readouterr().err.splitlines() == [
        f"oprag: skipping article 'Empty' (line 5 of {f}): no text under its heading",
        f"oprag: skipping article 'Empty' (line 12 of {f}): no text under its heading",
        f"oprag: skipping article 'Last' (line 15 of {f}): no text under its heading",
    ]
    assert TEXT.splitlines()[4] == " = Empty = " and TEXT.splitlines()[14] == " = Last = "


def test_headings_lists_each_articles_heading_line():
    headings: list[int] = []
    arts = list(wikitext_articles(TEXT, headings=headings))
    assert [t for t, _ in arts] == ["Kept", "Empty", "Kept", "Empty", "Last"]
    assert headings == [1, 5, 8, 12, 15]
    assert list(wikitext_articles(TEXT)) == arts  # (without the lists, as before)
