"""terrace report on real, small outputs of `demo`, `bench experts`, `bench kv` (with and without prefix rows)
and `verify kv` (each run here on k3-toy): each shape gets its charts; every SVG parses as XML, references
nothing outside the page, and its polylines / bars follow the JSON (point count = rows, heights ordered like
the values, stacked segments on each other); malformed bench kv JSON is rendered with the parts it could not
chart named on the page."""
import json
import re
import xml.etree.ElementTree as ET

import pytest

from conftest import SVG_NS as NS, render_report


def report(terrace, tmp_path, data, name):
    return render_report(terrace, tmp_path, data, name)[1]


def polyline(svg, name):
    for p in svg.iter(NS + "polyline"):
        if p.get("data-name") == name:
            return [tuple(map(float, xy.split(","))) for xy in p.get("points").split()]
    raise AssertionError(f"no series {name!r}")


def bars(svg):
    return [(r.get("class"), float(r.get("height"))) for r in svg.iter(NS + "rect") if "bar" in (r.get("class") or "")]


def same_order(heights, values):
    """Heights in pixels ordered like the values (ties allowed)."""
    for i in range(len(values)):
        for k in range(len(values)):
            if values[i] < values[k]:
                assert heights[i] <= heights[k] + 1e-6, (heights, values)


def svg_y_order(points, values):
    # SVG y grows downward: a larger value is a smaller y.
    same_order([-y for _, y in points], values)


@pytest.fixture(scope="module")
def toy(toy_model):
    return toy_model


@pytest.fixture(scope="module")
def demo_run(terrace, tmp_path_factory):
    d = tmp_path_factory.mktemp("demo-report") / "data"
    r = terrace("demo", "--dir", d, "--preset", "k3-toy", "--conversations", "2", "--turns", "2", "--system-tokens",
                "80", "--user-tokens", "16", "--new-tokens", "3", "--kv-nvme-size", "8MiB", "--state-nvme-size",
                "16MiB", timeout=300, check=True)
    return d, r, json.loads((d / "demo-run.json").read_text())


def bar_values(svg):
    """The value each bar's tooltip names ("<group> <bar>: <value>")."""
    return [float(r.find(NS + "title").text.rsplit(": ", 1)[1].rstrip("%")) for r in svg.iter(NS + "rect")
            if "bar" in (r.get("class") or "")]


def ref_line_y(svg, prefix):
    return next(float(l.get("y1")) for l in svg.iter(NS + "line") if (l.get("data-name") or "").startswith(prefix))


def test_demo_report(terrace, demo_run, tmp_path):
    d, r, j = demo_run
    assert str(d / "report.html") in r.stdout.splitlines()[-2]  # the demo ends by pointing at the report it wrote
    assert "<svg" in (d / "report.html").read_text()
    layers = j["summary"]["experts"]["layers"]
    assert layers and all(len(l["expert_load"]) > 0 for l in layers)
    c = report(terrace, tmp_path, j, "demo")
    assert {"ttft-per-turn", "tier-hit-rates-over-time", "prefix-restore-by-tier", "stall-per-token",
            "prefetch-per-layer", "expert-utilisation", "expert-load-histogram"} <= set(c)
    turns = j["turns"]
    n = len(turns)
    restore = polyline(c["ttft-per-turn"], "with restore")
    assert len(restore) == n and len(polyline(c["ttft-per-turn"], "full recompute")) == n
    svg_y_order(restore, [t["ttft_s"] for t in turns])
    # Tier hit rates over time: one point per turn that looked the tier up, at the turn's own rate.
    for name, rates in (("expert cache (hbm)", [t["experts"]["hit_rate"] for t in turns]),
                        ("prefix host", [t["prefix_hit_rate"]["host"] for t in turns])):
        pts = polyline(c["tier-hit-rates-over-time"], name)
        want = [x for x in rates if x is not None]
        assert len(pts) == len(want) > 0, name
        svg_y_order(pts, want)
    for tier in ("hbm", "host", "nvme"):
        assert len(polyline(c["prefix-restore-by-tier"], tier)) == n
    dec = polyline(c["stall-per-token"], "decode step")
    assert len(dec) == n
    svg_y_order(dec, [t["experts"]["stall_s_per_decode_token"] for t in turns])
    rec = polyline(c["prefetch-per-layer"], "recall")
    assert len(rec) == len(layers)
    svg_y_order(rec, [l["prefetch_recall"] for l in layers])
    # The per-expert chart: the layer with the most hot experts, its hot ones red, the hot line above the mean.
    pick = max(layers, key=lambda l: len(l["hot_experts"]))
    b = bars(c["expert-utilisation"])
    assert len(b) == len(pick["expert_load"])
    same_order([h for _, h in b], pick["expert_load"])
    assert {i for i, (cls, _) in enumerate(b) if cls == "bar hot"} == set(pick["hot_experts"])
    assert ref_line_y(c["expert-utilisation"], "hot") < ref_line_y(c["expert-utilisation"], "layer mean")
    # The histogram counts every expert of every MoE layer once; its red bins hold exactly the hot experts.
    hist = c["expert-load-histogram"]
    counts = bar_values(hist)
    assert sum(counts) == sum(len(l["expert_load"]) for l in layers)
    hot_bins = [v for (cls, _), v in zip(bars(hist), counts) if cls == "bar hot"]
    assert sum(hot_bins) == sum(len(l["hot_experts"]) for l in layers)


def test_bench_experts_report(terrace, toy, tmp_path):
    r = terrace("bench", "experts", "--model", toy, "--dir", tmp_path / "be", "--budgets", "25%,50%", "--decode", "8",
                "--json", timeout=300, check=True)
    j = json.loads(r.stdout)
    c = report(terrace, tmp_path, j, "experts")
    assert {"tokens-per-s", "stall-share", "stall-per-token", "hit-rate", "precision", "recall", "recall-per-layer",
            "expert-utilisation"} <= set(c)
    # The stall, hit-rate, precision and recall charts leave out the rows without that figure (null:
    # the mmap rows' stall; resident's hit rate, and the mmap rows' recall and precision), rather
    # than drawing them as 0 (or resident's hit rate as 1).
    def having(key):
        rows = [x for x in j["configs"] if x[key] is not None]
        assert 0 < len(rows) < len(j["configs"]), key
        return rows

    stalled = having("stall_share")
    for chart, key, rows in (("tokens-per-s", "tokens_per_s", j["configs"]), ("hit-rate", "hit_rate", having("hit_rate")),
                             ("stall-share", "stall_share", stalled), ("precision", "precision", having("precision")),
                             ("recall", "recall", having("recall"))):
        b = bars(c[chart])
        assert len(b) == len(rows)
        same_order([h for _, h in b], [x[key] for x in rows])
    # Stall per decoded token = stall share x decode time / decode tokens = stall_share / tokens_per_s.
    per_token = [1e3 * x["stall_share"] / x["tokens_per_s"] for x in stalled]
    assert bar_values(c["stall-per-token"]) == pytest.approx(per_token, rel=1e-3, abs=1e-3)
    first = next(cfg for cfg in j["configs"] if cfg["expert_load"])
    b = bars(c["expert-utilisation"])
    assert len(b) == len(first["expert_load"])
    same_order([h for _, h in b], first["expert_load"])
    assert {i for i, (cls, _) in enumerate(b) if cls == "bar hot"} == set(first["hot_experts"])
    def label(cfg):  # the same names repeat per budget: the label carries the budget
        b = cfg["budget_fraction"]
        return f"{cfg['name']} @ {100 * b:g}%" if 0 < b < 1 else cfg["name"]

    assert len({label(cfg) for cfg in j["configs"]}) == len(j["configs"])
    for cfg in j["configs"]:
        if cfg["layer_recall"]:
            pts = polyline(c["recall-per-layer"], label(cfg))
            assert len(pts) == len(cfg["layer_recall"])
            svg_y_order(pts, cfg["layer_recall"])


# Small multi-turn settings: k3-toy, 64-token chunks, a 128-token system prompt.
KV_SMALL = ("--chunk-tokens", "64", "--store-nvme-size", "8MiB", "--state-nvme-size", "16MiB", "--turns", "3",
            "--conversations", "2", "--system-tokens", "128", "--user-tokens", "48")
KV_MULTI_TURN_CHARTS = {"multi-turn-tokens", "multi-turn-ttft", "multi-turn-tier-shares"}
KV_CODEC_CHARTS = {"kv-bytes-per-token-by-codec", "state-bytes-per-snapshot-by-codec"}


def rects(svg):
    """The bars as dicts of their attributes and tooltip ("<group> <bar>: <value>"; the value a number, or
    None where the tooltip gives it with a unit, as byte charts do), in drawing order."""
    out = []
    for r in svg.iter(NS + "rect"):
        if "bar" not in (r.get("class") or ""):
            continue
        label, value = r.find(NS + "title").text.rsplit(": ", 1)
        number = value.rstrip("%")
        out.append({"class": r.get("class"), "y": float(r.get("y")), "h": float(r.get("height")), "label": label,
                    "value": float(number) if re.fullmatch(r"[-+.e0-9]+", number) else None})
    return out


def check_page(html, charts):
    """One inline SVG per chart, each under its own title; the page is not the generic fallback."""
    assert html.count("<svg") == len(charts)
    for svg in charts.values():
        title = svg.find(NS + "title").text
        for ch, ent in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ('"', "&quot;"), ("'", "&#39;")):
            title = title.replace(ch, ent)  # as the report escapes it
        assert f"<title>{title}</title>" in html
    assert "<title>Terrace bench kv: " in html and "Not charted" not in html


def check_tier_shares(svg, rows, label):
    """Stacked hbm/host/nvme bars per row at the row's hit_rate_by_tier, each segment on the one below."""
    b = rects(svg)
    assert len(b) == 3 * len(rows)
    for i, row in enumerate(rows):
        group = b[3 * i:3 * i + 3]
        assert [g["label"] for g in group] == [f"{label(row)} {t}" for t in ("hbm", "host", "nvme")]
        assert [g["value"] for g in group] == pytest.approx([100 * row["hit_rate_by_tier"][t]
                                                            for t in ("hbm", "host", "nvme")], abs=0.5)
        for low, high in zip(group, group[1:]):
            assert high["y"] + high["h"] == pytest.approx(low["y"], abs=0.15)


def check_multi_turn(c, mt):
    rows = mt["rows"]
    assert len(rows) == mt["conversations"] * mt["turns"]
    label = lambda r: f"t{r['turn']} c{r['conversation']}"  # noqa: E731
    # Restored (bottom) and computed (top) stacked: heights in proportion, the stack the prompt.
    tok = rects(c["multi-turn-tokens"])
    assert len(tok) == 2 * len(rows)
    scale = max(t["h"] for t in tok[1::2]) / max(r["computed_tokens"] for r in rows)
    for (restored, computed), row in zip(zip(tok[0::2], tok[1::2]), rows):
        assert restored["label"] == f"{label(row)} restored" and computed["label"] == f"{label(row)} computed"
        assert restored["h"] == pytest.approx(scale * row["restored_tokens"], abs=0.3)
        assert computed["h"] == pytest.approx(scale * row["computed_tokens"], abs=0.3)
        assert computed["y"] + computed["h"] == pytest.approx(restored["y"], abs=0.15)
        assert row["restored_tokens"] + row["computed_tokens"] == row["prompt_tokens"]
    assert any(r["restored_tokens"] > 0 for r in rows) and rows[0]["restored_tokens"] == 0
    ttft = rects(c["multi-turn-ttft"])
    assert [t["value"] for t in ttft[0::2]] == pytest.approx([1e3 * r["ttft_restore_s"] for r in rows], rel=1e-4)
    assert [t["value"] for t in ttft[1::2]] == pytest.approx([1e3 * r["restore_wait_s"] for r in rows], rel=1e-4,
                                                              abs=1e-6)
    same_order([t["h"] for t in ttft[0::2]], [r["ttft_restore_s"] for r in rows])
    check_tier_shares(c["multi-turn-tier-shares"], rows, label)


def check_codecs(c, j):
    for chart, nominal, stored, used in (
            ("kv-bytes-per-token-by-codec", "kv_bytes_per_token", "kv_block_bytes_per_token", j["kv_codec"]),
            ("state-bytes-per-snapshot-by-codec", "state_bytes_per_snapshot", "state_block_bytes_per_snapshot",
             j["state_codec"])):
        by = j["bytes_per_token_by_codec"]
        b = rects(c[chart])
        assert len(b) == 2 * len(by)
        names = [x["label"].rsplit(" ", 1)[0] for x in b[0::2]]
        assert sorted(names) == sorted(by)
        same_order([x["h"] for x in b[0::2]], [by[n][nominal] for n in names])
        same_order([x["h"] for x in b[1::2]], [by[n][stored] for n in names])
        assert [x["h"] for x in b[0::2]] == sorted((x["h"] for x in b[0::2]), reverse=True)  # largest first
        # The codec the run used is the one outlined (both its bars).
        assert [x["label"] for x in b if "marked" in x["class"]] == [f"{used} nominal", f"{used} as stored"]


def test_bench_kv_report(terrace, toy, tmp_path):
    r = terrace("bench", "kv", "--model", toy, "--dir", tmp_path / "kv", "--prefix-tokens", "64,128,256",
                "--state-codec", "int8", *KV_SMALL, "--json", timeout=300, check=True)
    j = json.loads(r.stdout)
    c = report(terrace, tmp_path, j, "kv")
    assert {"ttft-vs-prefix", "restore-bandwidth", "tier-hit-rates-by-prefix"} | KV_MULTI_TURN_CHARTS | \
        KV_CODEC_CHARTS == set(c)
    check_page((tmp_path / "kv.html").read_text(), c)
    rows = j["rows"]
    for chart, series, key in (("ttft-vs-prefix", "restore", "ttft_restore_s"),
                               ("ttft-vs-prefix", "recompute", "ttft_recompute_s"),
                               ("restore-bandwidth", "restore", "restore_mb_per_s"),
                               ("restore-bandwidth", "tier read", "tier_read_mb_per_s")):
        pts = polyline(c[chart], series)
        assert len(pts) == len(rows)
        svg_y_order(pts, [row[key] for row in rows])
        assert [x for x, _ in pts] == sorted(x for x, _ in pts)  # x follows the prefix length
    assert all(row["hit_rate_by_tier"]["nvme"] == 1 for row in rows)  # --tier nvme: every block from NVMe
    check_tier_shares(c["tier-hit-rates-by-prefix"], rows, lambda row: str(row["prefix_tokens"]))
    check_multi_turn(c, j["multi_turn"])
    check_codecs(c, j)


def test_bench_kv_multi_turn_only_report(terrace, toy, tmp_path):
    """--prefix-tokens none: a bench kv page (not the generic table) with the multi-turn and codec charts.
    Small host tiers make later turns restore part of their blocks from NVMe."""
    r = terrace("bench", "kv", "--model", toy, "--dir", tmp_path / "kv", "--prefix-tokens", "none", *KV_SMALL,
                "--store-host-size", "1MiB", "--state-host-size", "1MiB", "--json", timeout=300, check=True)
    j = json.loads(r.stdout)
    assert j["rows"] == []
    c = report(terrace, tmp_path, j, "mt")
    assert KV_MULTI_TURN_CHARTS | KV_CODEC_CHARTS == set(c)
    html = (tmp_path / "mt.html").read_text()
    check_page(html, c)
    assert "No per-prefix rows" in html
    shares = [row["hit_rate_by_tier"] for row in j["multi_turn"]["rows"]]
    assert any(s["nvme"] > 0 for s in shares) and any(s["host"] > 0 for s in shares)
    check_multi_turn(c, j["multi_turn"])
    check_codecs(c, j)


def test_bench_kv_report_skips_malformed_parts_visibly(terrace, tmp_path):
    """Hand-written bench kv JSON with missing or malformed parts: the page still renders (exit 0), draws
    what it can, and names each part it left out and why."""
    row = {"prefix_tokens": 64, "ttft_restore_s": 0.01, "ttft_recompute_s": 0.02}  # no hit_rate_by_tier
    codecs = {"bf16": {"kv_bytes_per_token": 320, "kv_block_bytes_per_token": 448, "state_bytes_per_snapshot": 9,
                       "state_block_bytes_per_snapshot": 10}, "f32": 7}
    j = {"model": "m", "tier": "nvme", "kv_codec": "bf16+zstd", "state_codec": "f32", "rows": [row],
         "multi_turn": "oops", "bytes_per_token_by_codec": codecs}
    c = report(terrace, tmp_path, j, "bad")
    html = (tmp_path / "bad.html").read_text()
    assert {"ttft-vs-prefix", "restore-bandwidth"} | KV_CODEC_CHARTS == set(c)
    assert ("Not charted: the hit rate per tier of prefix 64 (hit_rate_by_tier is missing, not an object, or lacks a "
            "tier&#39;s share)") in html
    assert "Not charted: the multi-turn workload (multi_turn is not an object)" in html
    assert "Not charted: codec f32 (its bytes_per_token_by_codec entry is not an object)" in html
    # bf16+zstd: the table has no lossless stages; bf16 is outlined and the subtitle says why.
    kv = c["kv-bytes-per-token-by-codec"]
    assert [x["label"] for x in rects(kv) if "marked" in x["class"]] == ["bf16 nominal", "bf16 as stored"]
    assert "before its lossless stage" in ET.tostring(kv, encoding="unicode")
    # Only the multi-turn part (rows empty), its rows malformed: turn rows that are not objects or lack keys.
    mt = {"conversations": 1, "turns": 2, "rows": [{"turn": 1, "conversation": 1, "restored_tokens": "x",
                                                      "hit_rate_by_tier": [1]}, 5]}
    c = report(terrace, tmp_path, {"rows": [], "multi_turn": mt}, "bad2")
    html = (tmp_path / "bad2.html").read_text()
    assert "<title>Terrace bench kv: " in html
    assert {"multi-turn-tokens", "multi-turn-ttft"} == set(c)
    assert ("Not charted: the tier shares of turn t1 c1, t? c? (hit_rate_by_tier is missing, not an object, or "
            "lacks a tier&#39;s share)") in html
    assert "Not charted: the bytes per codec (bytes_per_token_by_codec is missing, empty or not an object)" in html
    for name, j, note in (("bad3", {"rows": [], "multi_turn": {}}, "multi_turn.rows is missing or empty"),
                          ("bad4", {"bytes_per_token_by_codec": []}, "bytes_per_token_by_codec is missing")):
        assert report(terrace, tmp_path, j, name) == {}
        assert note in (tmp_path / f"{name}.html").read_text()


def test_verify_kv_report(terrace, toy, tmp_path):
    r = terrace("verify", "kv", "--model", toy, "--codecs", "bf16,fp8,int4-g32", "--context", "128",
                "--chunk-tokens", "64", "--eval-tokens", "8", "--json", timeout=300, check=True)
    j = json.loads(r.stdout)
    c = report(terrace, tmp_path, j, "verify")
    rows = j["rows"]
    b = bars(c["codec-compression"])
    assert len(b) == len(rows)
    same_order([h for _, h in b], [row["compression_ratio"] for row in rows])
    kl = bars(c["codec-kl"])
    assert len(kl) == 2 * len(rows)
    same_order([h for _, h in kl[0::2]], [row["kl_mean"] for row in rows])
    assert len(bars(c["codec-top1"])) == len(rows)
    overlap = bars(c["codec-attention-overlap"])  # mean and min per codec
    assert len(overlap) == 2 * len(rows)
    same_order([h for _, h in overlap[0::2]], [row["top8_overlap_mean"] for row in rows])
    same_order([h for _, h in overlap[1::2]], [row["top8_overlap_min"] for row in rows])
    titles = [t.text for t in c["codec-kl"].iter(NS + "title")]
    assert all(any(row["codec"] in (t or "") for t in titles) for row in rows)


def test_report_escapes_text(terrace, tmp_path):
    j = {"rows": [{"codec": "<b>&x\"", "kl_mean": 1, "kl_max": 2, "top1_agreement": 0.5, "compression_ratio": 3}]}
    c = report(terrace, tmp_path, j, "esc")
    html = (tmp_path / "esc.html").read_text()
    assert "<b>&x" not in html and "&lt;b&gt;&amp;x" in html
    assert c["codec-kl"] is not None


def _png_pixels(path):
    """(width, height, rows of RGB(A) bytes) of a non-interlaced 8-bit PNG, decoded with zlib only."""
    import struct
    import zlib

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def _png_chunks(path):
    """[(type, data)] of every chunk, each CRC checked with zlib's CRC-32 (independent of Terrace's)."""
    import struct
    import zlib

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body), (path, kind)
        chunks.append((kind, body))
        pos += 12 + n
    return chunks


def _colours(path, step=2):
    _, _, bpp, rows = _png_pixels(path)
    colours = set()
    for row in rows[::step]:
        for i in range(0, len(row), bpp * step):
            colours.add(tuple(row[i:i + 3]))
    return colours


BLUE, RED, HOT = (0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28), (0xC0, 0x39, 0x2B)


def test_report_png_charts(terrace, demo_run, tmp_path):
    """--png: one PNG per chart, 720x380, drawn (the first series' blue is in each; the hot experts' red in
    the per-expert chart). Skipped without rsvg-convert."""
    import shutil

    if not shutil.which("rsvg-convert"):
        pytest.skip("rsvg-convert is not installed (apt-get install librsvg2-bin for --png)")
    d, _, j = demo_run
    assert any(l["hot_experts"] for l in j["summary"]["experts"]["layers"])
    out = tmp_path / "demo.html"
    r = terrace("report", d / "demo-run.json", "-o", out, "--png", check=True)
    pngs = {p.stem[len("demo-"):]: p for p in tmp_path.glob("demo-*.png")}
    assert {"ttft-per-turn", "stall-per-token", "expert-utilisation", "expert-load-histogram"} <= set(pngs)
    assert not list(tmp_path.glob("*.svg"))  # --png alone writes no SVG files
    for name, p in pngs.items():
        assert str(p) in r.stdout
        w, h, _, _ = _png_pixels(p)
        assert (w, h) == (720, 380), name
        assert BLUE in _colours(p, 1), name
        assert _png_chunks(p)[1] == (b"tEXt", b"Software\0terrace"), name  # Terrace's mark, after IHDR
    assert HOT in _colours(pngs["expert-utilisation"], 1)


def test_report_png_without_the_rasteriser_fails_and_writes_nothing(terrace, tmp_path):
    import os
    import subprocess

    src, out = tmp_path / "plan.json", tmp_path / "plan.html"
    src.write_text(terrace("plan", "--json", check=True).stdout)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    r = subprocess.run([terrace.path, "report", str(src), "-o", str(out), "--png"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PATH": str(empty)})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "--png" in r.stderr and "librsvg2-bin" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty-path", "plan.json"]


def test_report_png_refuses_a_rasteriser_output_that_is_no_png(terrace, tmp_path):
    """A tool that prints only the 8-byte PNG signature was taken for a rasteriser: its 'PNGs' replaced the
    earlier charts and, lacking the mark, blocked the next run."""
    import os
    import subprocess

    src, out = tmp_path / "plan.json", tmp_path / "plan.html"
    src.write_text(terrace("plan", "--json", check=True).stdout)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "rsvg-convert"
    fake.write_text("#!/bin/sh\ncat > /dev/null\nprintf '\\211PNG\\r\\n\\032\\n'\n")
    fake.chmod(0o755)
    r = subprocess.run([terrace.path, "report", str(src), "-o", str(out), "--png"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "--png: " in r.stderr and "failed on the" in r.stderr, r.stderr
    assert not list(tmp_path.glob("plan-*.png"))


def test_bench_tiers_report(terrace, tmp_path):
    r = terrace("bench", "tiers", "--tier", "host", "--op", "read", "--block-size", "1MiB", "--queue-depth", "4",
                "--total-bytes", "16MiB", "--repeat", "3", "--json", timeout=120, check=True)
    j = json.loads(r.stdout)
    c = report(terrace, tmp_path, j, "tiers")
    assert {"throughput-per-pass", "latency"} <= set(c)
    assert bar_values(c["throughput-per-pass"]) == pytest.approx(j["passes_mb_per_s"], rel=1e-5)
    same_order([h for _, h in bars(c["throughput-per-pass"])], j["passes_mb_per_s"])
    assert bar_values(c["latency"]) == pytest.approx([j["p50_us"], j["p99_us"]], rel=1e-5)


def test_bench_store_report(terrace, tmp_path):
    r = terrace("bench", "store", "--dir", tmp_path / "store", "--total-bytes", "16MiB", "--repeat", "1", "--json",
                timeout=120, check=True)
    j = json.loads(r.stdout)
    c = report(terrace, tmp_path, j, "store")
    want = [v for k, v in j.items() if k.endswith("_mb_per_s") and isinstance(v, (int, float))]
    assert len(want) >= 4
    assert bar_values(c["store-throughput"]) == pytest.approx(want, rel=1e-5)


def texts(svg):
    return [t.text or "" for t in svg.iter(NS + "text")]


def page_text(html):
    """The page's text outside its charts, tags dropped."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", re.sub(r"<svg.*?</svg>", "", html, flags=re.S)))


def points(svg, name):
    try:
        return polyline(svg, name)
    except AssertionError:
        return []  # a series with no point draws no line


def test_demo_report_draws_no_decode_point_for_a_turn_without_a_decode_step(terrace, demo_run, tmp_path):
    """A demo-run.json of a Terrace before the fix wrote 0 for the stall per decode step of a turn that
    generated one token (no decode step): the chart has no point for it, and a null summary figure reads
    "not recorded" on the page."""
    _, _, j = demo_run
    j = json.loads(json.dumps(j))
    first = j["turns"][0]
    first["generated"] = first["generated"][:1]
    first["experts"]["stall_s_per_decode_token"] = 0.0
    j["summary"]["decode_tokens_per_s"] = None
    c = report(terrace, tmp_path, j, "nodecode")
    dec = points(c["stall-per-token"], "decode step")
    assert len(dec) == len(j["turns"]) - 1  # every turn but the first
    assert len(points(report(terrace, tmp_path, demo_run[2], "all")["stall-per-token"], "decode step")) == len(j["turns"])
    assert "(decode not recorded)" in page_text((tmp_path / "nodecode.html").read_text())


def test_plan_report_shows_the_plans_warnings_first_and_units_of_with_stalls_rates(terrace, tmp_path):
    hw = tmp_path / "hw1.json"
    hw.write_text('{"base": "h100-gen4", "gpus": 1}')
    j = json.loads(terrace("plan", "--hardware", hw, "--json", check=True).stdout)
    assert any("does not fit" in w for w in j["warnings"])
    report(terrace, tmp_path, j, "nofit")
    html = (tmp_path / "nofit.html").read_text()
    head = html[:html.index("<h2>")]  # above every figure
    for w in j["warnings"]:
        esc = w.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;").replace("'", "&#39;")
        assert f'<p class="warning">Warning: {esc}</p>' in head, w
    # A rate with stalls has the unit of the rate: "/s", as decode tokens per s has.
    m = re.search(r"decode tokens per s with stalls</th><td>([^<]*)</td>", html)
    assert m and m.group(1).endswith(" /s"), m


def test_null_figures_are_not_drawn_or_printed_as_zero(terrace, tmp_path):
    """Null figures (not recorded) of each kind of run: a table says "not recorded", a chart has no bar or
    point for them and its subtitle names what it left out; nothing reads as a measured 0."""
    share = {"hbm": 0.0, "host": 1.0, "nvme": 0.0}
    rows = [{"turn": 1, "conversation": 1, "restored_tokens": 0, "computed_tokens": 40, "ttft_restore_s": 0.02,
             "restore_wait_s": 0.0, "hit_rate_by_tier": share, "blocks_requested": 0},
            {"turn": 2, "conversation": 1, "restored_tokens": None, "computed_tokens": 8, "ttft_restore_s": None,
             "restore_wait_s": 0.001, "hit_rate_by_tier": dict(share, nvme=None), "blocks_requested": 2}]
    codecs = {"bf16": {"kv_bytes_per_token": 320, "kv_block_bytes_per_token": 448, "state_bytes_per_snapshot": 9,
                       "state_block_bytes_per_snapshot": 10},
              "f32": {"kv_bytes_per_token": 640, "kv_block_bytes_per_token": None, "state_bytes_per_snapshot": 18,
                      "state_block_bytes_per_snapshot": 20}}
    kv = {"model": "m", "kv_codec": "bf16", "state_codec": "f32", "rows": [], "bytes_per_token_by_codec": codecs,
          "multi_turn": {"conversations": 1, "turns": 2, "rows": rows, "restored_tokens": None, "computed_tokens": 48,
                         "ttft_restore_s_sum": None, "seconds": 0.5}}
    c = report(terrace, tmp_path, kv, "nullkv")
    text = page_text((tmp_path / "nullkv.html").read_text())
    assert "prompt tokens not recorded restored, 48 computed (not recorded restored)" in text
    assert "TTFT summed over the turns not recorded;" in text
    assert "Not charted: the tier shares of turn t2 c1" in text
    for name in ("multi-turn-tokens", "multi-turn-ttft"):
        assert len(rects(c[name])) == 2 and {x["label"].split()[0] for x in rects(c[name])} == {"t1"}, name
        assert any(t.endswith("no bar (not recorded): t2 c1") for t in texts(c[name])), name
    kvc = c["kv-bytes-per-token-by-codec"]
    assert {x["label"].split()[0] for x in rects(kvc)} == {"bf16"}
    assert any(t.endswith("no bar (not recorded): f32") for t in texts(kvc))
    # A plan with null expert stalls, a null sweep point, a null ceiling and a null tier hit rate.
    plan = {"kind": "plan", "model": "m", "workload": {}, "memory": {},
            "experts": {"stall_s_per_token_batch1": None, "stall_s_per_token_batched": 0.002},
            "trace": {"file": "t.jsonl", "prefix_hit_ceiling": None,
                      "sweep": [{"policy": "lru", "capacity_bytes": 1 << 30, "hit_rate": None},
                                {"policy": "lru", "capacity_bytes": 2 << 30, "hit_rate": 0.5},
                                {"policy": "lru", "capacity_bytes": 4 << 30, "hit_rate": 0.6}],
                      "policies": [{"policy": "lru", "tiers": [{"name": "hbm", "hit_rate": None},
                                                               {"name": "host", "hit_rate": 0.2}]},
                                   {"policy": "lfu", "tiers": [{"name": "hbm", "hit_rate": 0.1},
                                                               {"name": "host", "hit_rate": 0.3}]}]}}
    c = report(terrace, tmp_path, plan, "nullplan")
    st = c["stall-per-token"]
    assert [x["label"] for x in rects(st)] == ["batched (--concurrency) stall per token"]
    assert any(t.endswith("no bar (not recorded): batch 1") for t in texts(st))
    sw = c["hit-rate-vs-capacity"]
    assert len(points(sw, "lru")) == 2 and points(sw, "ceiling (infinite cache)") == []
    assert any("no point (not recorded): lru at 1 GiB" in t and "no line (not recorded): the ceiling" in t
               for t in texts(sw))
    th = c["tier-hit-rates"]
    assert {x["label"].split()[0] for x in rects(th)} == {"lfu"}
    assert any(t.endswith("no bar (not recorded): lru") for t in texts(th))
    # bench tiers with a null pass and null reported and p99 figures; verify kv with a null figure.
    tiers = {"tier": "host", "op": "read", "passes_mb_per_s": [100.0, None, 120.0], "mb_per_s": None,
             "p50_us": 5.0, "p99_us": None}
    c = report(terrace, tmp_path, tiers, "nulltiers")
    assert bar_values(c["throughput-per-pass"]) == [100.0, 120.0]
    assert not list(c["throughput-per-pass"].iter(NS + "line")) or all(
        l.get("class") != "ref" for l in c["throughput-per-pass"].iter(NS + "line"))
    assert any("the reported figure: not recorded" in t and "no bar (not recorded): 2" in t
               for t in texts(c["throughput-per-pass"]))
    assert bar_values(c["latency"]) == [5.0]
    ver = {"rows": [{"codec": "bf16", "kl_mean": 0.01, "kl_max": 0.02, "top1_agreement": 1.0, "compression_ratio": 2},
                    {"codec": "fp8", "kl_mean": None, "kl_max": 0.1, "top1_agreement": 0.9, "compression_ratio": 4}]}
    c = report(terrace, tmp_path, ver, "nullver")
    assert {x["label"].split()[0] for x in rects(c["codec-kl"])} == {"bf16"}
    assert len(rects(c["codec-top1"])) == 2


def test_the_page_is_well_formed_xml_and_an_old_marked_page_is_still_terraces(terrace, demo_run, tmp_path):
    """docs/plan.md: the page stays well-formed XML (strict expat parse); a page carrying the mark as
    written before it was self-closed is still replaced without --force."""
    src = tmp_path / "demo.json"
    src.write_text(json.dumps(demo_run[2]))
    out = tmp_path / "demo.html"
    terrace("report", src, "-o", out, check=True)
    html = out.read_text()
    ET.fromstring(html.replace("<!DOCTYPE html>", "", 1))
    out.write_text(html.replace('<meta name="generator" content="terrace"/>', '<meta name="generator" content="terrace">'))
    terrace("report", src, "-o", out, check=True)
    assert out.read_text() == html


def test_a_report_removes_the_charts_an_earlier_report_to_the_same_file_left(terrace, tmp_path):
    trace = tmp_path / "t.jsonl"
    terrace("trace", "gen", "--requests", "20", "-o", trace, check=True)
    for name, extra in (("plan", []), ("plantrace", ["--trace", trace])):
        r = terrace("plan", "--model", "k3-toy", *extra, "--json", check=True)
        (tmp_path / f"{name}.json").write_text(r.stdout)
    out = tmp_path / "r.html"
    terrace("report", tmp_path / "plantrace.json", "-o", out, "--svg", check=True)
    four = {p.name for p in tmp_path.glob("r-*.svg")}
    assert {"r-hit-rate-vs-capacity.svg", "r-tier-hit-rates.svg"} < four, four
    # The user's own files beside them, one with a chart's name but not written by Terrace: kept.
    (tmp_path / "r-notes.svg").write_text("<svg/>")
    (tmp_path / "r-tier-hit-rates.png").write_bytes(b"my own picture")
    # A plan without a trace draws two charts: the trace's two must not stay beside the new page.
    r = terrace("report", tmp_path / "plan.json", "-o", out, "--svg", check=True)
    two = {p.name for p in tmp_path.glob("r-*.svg")} - {"r-notes.svg"}
    assert two < four and "r-tier-hit-rates.svg" not in two and "r-hit-rate-vs-capacity.svg" not in two, two
    assert f"removed {tmp_path / 'r-tier-hit-rates.svg'}" in r.stdout, r.stdout
    # Without --svg the page's charts are only inline: no chart file of the earlier runs stays.
    r = terrace("report", tmp_path / "plan.json", "-o", out, check=True)
    assert {p.name for p in tmp_path.glob("r-*")} == {"r-notes.svg", "r-tier-hit-rates.png"}, r.stdout
    assert (tmp_path / "r-tier-hit-rates.png").read_bytes() == b"my own picture"
    # Another page of the same stem (r.htm) keeps its charts: only the page at this -o lists what it wrote.
    terrace("report", tmp_path / "plantrace.json", "-o", tmp_path / "r.htm", "--svg", check=True)
    theirs = {p.name for p in tmp_path.glob("r-*.svg")} - {"r-notes.svg"}
    assert len(theirs) == 4, theirs
    r = terrace("report", tmp_path / "plan.json", "-o", out, check=True)
    assert "removed" not in r.stdout and {p.name for p in tmp_path.glob("r-*.svg")} - {"r-notes.svg"} == theirs


def test_demo_page_says_not_equal_when_a_turn_differs_whatever_verified_says(terrace, demo_run, tmp_path):
    _, _, j = demo_run
    assert j["verified"] is True and all(t["equal"] for t in j["turns"])
    report(terrace, tmp_path, j, "good")
    assert "<b>bitwise equal</b>" in (tmp_path / "good.html").read_text()
    bad = json.loads(json.dumps(j))
    bad["turns"][1]["equal"] = False
    bad["turns"][1]["max_abs_diff"] = 3.5
    report(terrace, tmp_path, bad, "bad")
    html = (tmp_path / "bad.html").read_text()
    assert "bitwise equal" not in html and "<b>NOT EQUAL (turn 2 differs from the recompute)</b>" in html
    del bad["verified"]  # a differing turn decides even when the verdict itself was not recorded
    report(terrace, tmp_path, bad, "unrecorded")
    assert "<b>NOT EQUAL (turn 2 differs from the recompute)</b>" in (tmp_path / "unrecorded.html").read_text()


def test_a_point_the_axes_cannot_place_is_said_not_dropped_silently(terrace, tmp_path):
    trace = tmp_path / "t.jsonl"
    terrace("trace", "gen", "--requests", "20", "-o", trace, check=True)
    j = json.loads(terrace("plan", "--model", "k3-toy", "--trace", trace, "--json", check=True).stdout)
    good = report(terrace, tmp_path, j, "good")["hit-rate-vs-capacity"]
    assert "not drawn" not in ET.tostring(good, encoding="unicode")
    for row in j["trace"]["sweep"][:2]:
        row["capacity_bytes"] = -5  # on the log axis: no place for it
    text = ET.tostring(report(terrace, tmp_path, j, "bad")["hit-rate-vs-capacity"], encoding="unicode")
    assert re.search(r"\b[23] points not drawn \(not a finite number, or not above 0 on a log axis\)", text), text[:600]
