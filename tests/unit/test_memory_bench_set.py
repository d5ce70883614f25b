"""The follow-up evaluation set of bench/memory.py: deterministic and built by its stated rules."""

from __future__ import annotations

from pathlib import Path

from bench import memory as mb  # the repository root is on sys.path under `python -m pytest`

FILLER = "The committee met again and the report was filed in the usual way by the clerk . "


def _article(title: str, detail: str) -> str:
    # paragraphs sized in MiniLM tokens so that each is one chunk (window) of the server's
    # 256-token chunker: window 0 filler (~205 tokens); window 1 the detail (~240 tokens, the
    # only window of >= 300 characters after the first, so it is the target); window 2 a short
    # coda (~30 tokens: too big to join window 1)
    body = [FILLER * 12, detail + " " + FILLER * 13, "The record ends here for now . " * 5]
    return f" = {title} = \n\n" + "\n\n".join(" " + p for p in body) + "\n\n"


def _write(tmp_path: Path) -> Path:
    arts = [
        _article("Alpha River", "Its estuary hosts herons , otters and the rare quillwort beside a harbour ."),
        _article("Beta Castle", "The keep held herons , a harbour chain and the unique vexillum banner ."),
        _article("Gamma Mill", "Millers kept herons near the harbour and one zymurgy ledger ."),
        _article("Delta <unk> Town", "A harbour ."),
    ]
    f = tmp_path / "tiny.txt"
    f.write_text("".join(arts), encoding="utf-8")
    return f


def test_set_rules_and_determinism(tmp_path: Path) -> None:
    f = _write(tmp_path)
    pairs, info = mb.build_pairs(f)
    again, _ = mb.build_pairs(f)
    assert [p["followup"] for p in pairs] == [p["followup"] for p in again]
    assert info["articles"] == 4 and info["skipped"]["unk_title"] == 1
    assert [p["title"] for p in pairs] == ["Alpha River", "Beta Castle", "Gamma Mill"]
    for p in pairs:
        assert p["window"] >= 1  # never the first window
        t = p["windows"][p["window"]].casefold()
        # the shared word occurs in >= 3 articles, appears in the target window, and in no
        # other window of its own article
        assert p["shared_keyword_df"] >= mb.SHARED_MIN_DF
        assert p["shared_keyword"] in t
        others = [w.casefold() for i, w in enumerate(p["windows"]) if i != p["window"]]
        assert all(p["shared_keyword"] not in w for w in others)
        assert p["followup"] == f"What about its {p['shared_keyword']}?"
        assert p["selfcontained"].startswith(f"What does {p['title']} say about ")
        assert p["title"] not in p["followup"] and p["title"] not in p["specific"]
        assert len(p["keywords"]) == mb.N_KEYWORDS
        # specific keywords are the rarest: df never above the shared keyword's
        assert max(p["keyword_df"]) <= p["shared_keyword_df"] or min(p["keyword_df"]) == 1
    # "herons"/"harbour" occur in all three usable articles (and Delta): shared, not specific
    assert {p["shared_keyword"] for p in pairs} <= {"herons", "harbour"}
    # specific keywords: df ascending, then first position in the window
    assert pairs[0]["keywords"] == ["estuary", "hosts", "otters"]
    assert pairs[1]["keywords"] == ["keep", "held", "chain"]
