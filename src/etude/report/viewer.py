"""The report's trajectory viewer: per-trajectory data for the page, and the page's HTML/CSS/JS.

The viewer lets a reader pick one episode (by run, step, task, reward, flags, hints) and read it
turn by turn: the prompt, each assistant turn with its parsed tool calls and typed tool-call
errors, each tool observation, the text-feedback hints at the turns where they were spliced (the
teacher saw the hint as a system message just before that turn), the per-token KL of hinted turns
as a heat map over the turn's tokens, and the monitor's flags with their evidence.

Per-token KL is read from ``Trajectory.info["kl"]``: a map from the turn index (an int, or its
string form after a JSON round trip) to a list of floats, either one per token of the turn's
``token_ids`` or one per trainable token (the KL's targets, in order). Tokens are shown as text
pieces decoded by the run's tokenizer (``RUN/tokenizer``) when there is one; without it, or when
the list fits neither alignment, the values are drawn as a strip of cells under the turn's text.

Python builds plain JSON-able records (``viewer_record``); the JavaScript in ``VIEWER_JS`` renders
them in the browser. Records are bounded: long texts are cut in the middle and the report embeds
at most ``--max-trajectories`` episodes (``select_trajectories`` keeps flagged and hinted ones
first, spread over the run).

What it does not do: load run directories (``etude.report.run_data``), or show token logprobs.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from typing import Any

from etude.env.trajectory import Trajectory
from etude.model.tokenizer import Tokenizer

MAX_TURN_CHARS = 6000
"""Longer turn texts keep their first and last parts, with a marker saying how much was cut."""
MAX_TESTS = 60
"""Test ids listed per trajectory (the counts cover all of them)."""
MAX_EVIDENCE_CHARS = 600


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable character -> the byte it stands for.

    Byte-level BPE (Radford et al. 2019, GPT-2) writes each byte as one printable character:
    bytes that are printable Latin-1 map to themselves, the others to 256, 257, ... in order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_to_byte = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in char_to_byte.values():
            char_to_byte[chr(256 + extra)] = b
            extra += 1
    return char_to_byte


_CHAR_TO_BYTE = _byte_level_decoder()


def token_pieces(tokenizer: Tokenizer, token_ids: Sequence[int]) -> list[str]:
    """The text each token adds, so that ``"".join(pieces) == tokenizer.decode(token_ids)``.

    A token that ends inside a multi-byte character adds nothing; the token that completes the
    character carries all of it (an incremental UTF-8 decoder over the tokens' bytes).
    """
    special = set(tokenizer.special_ids.values())
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = []
    for token_id in token_ids:
        token_id = int(token_id)
        if token_id in special:
            pieces.append(decoder.decode(b"", final=True) + tokenizer.id_to_token(token_id))
            decoder.reset()
            continue
        token = tokenizer.id_to_token(token_id)
        if all(c in _CHAR_TO_BYTE for c in token):
            pieces.append(decoder.decode(bytes(_CHAR_TO_BYTE[c] for c in token)))
        else:
            pieces.append(decoder.decode(b"", final=True) + tokenizer.decode([token_id]))
            decoder.reset()
    if pieces:
        pieces[-1] += decoder.decode(b"", final=True)
    return pieces


def turn_kl(traj: Trajectory, turn_index: int) -> list[float] | None:
    """The per-token KL recorded for one turn (``info["kl"]``), or None."""
    kl = traj.info.get("kl")
    if not isinstance(kl, dict):
        return None
    values = kl.get(str(turn_index), kl.get(turn_index))
    if not isinstance(values, list) or not values:
        return None
    return [float(v) if _finite(v) else float("nan") for v in values]


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _cut(text: str, limit: int) -> tuple[str, int]:
    """``text`` with its middle cut to fit ``limit`` characters; also how many were cut."""
    if len(text) <= limit:
        return text, 0
    head, tail = limit * 3 // 4, limit // 4
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut:,} characters cut ...]\n{text[-tail:]}", cut


def _kl_view(traj: Trajectory, i: int, tokenizer: Tokenizer | None) -> dict[str, Any] | None:
    """Heat-map data of one turn: token pieces (or None) and one value (or None) per cell."""
    values = turn_kl(traj, i)
    if values is None:
        return None
    turn = traj.turns[i]
    n = len(turn.token_ids)
    trainable = [k for k, t in enumerate(turn.trainable) if t]
    if n and len(values) == n:
        cells: list[float | None] = list(values)
        align = "tokens"
    elif n and trainable and len(values) == len(trainable):
        cells = [None] * n
        for k, v in zip(trainable, values):
            cells[k] = v
        align = "trainable"
    else:
        cells, align = list(values), "values"
    pieces = None
    if tokenizer is not None and align != "values":
        if max(turn.token_ids) < tokenizer.vocab_size:  # else: not this tokenizer's ids
            pieces = token_pieces(tokenizer, turn.token_ids)
    finite = [v for v in values if math.isfinite(v)]
    return {
        "align": align,
        "tokens": pieces,
        "values": [None if v is None or not math.isfinite(v) else round(v, 6) for v in cells],
        "mean": sum(finite) / len(finite) if finite else None,
        "max": max(finite) if finite else None,
    }


def viewer_record(
    traj: Trajectory,
    *,
    index: int,
    run: int,
    step: int | None,
    source: str,
    tokenizer: Tokenizer | None = None,
    max_chars: int = MAX_TURN_CHARS,
) -> dict[str, Any]:
    """One trajectory as the viewer's JSON: summary fields for the picker, turns for reading."""
    turns = []
    for i, turn in enumerate(traj.turns):
        text, cut = _cut(turn.text, max_chars)
        turns.append(
            {
                "role": turn.role,
                "text": text,
                "cut": cut,
                "tool_name": turn.tool_name,
                "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in turn.tool_calls],
                "errors": [
                    {"kind": e.kind, "message": e.message, "tool": e.tool} for e in turn.errors
                ],
                "num_tokens": len(turn.token_ids),
                "num_generated": sum(turn.trainable),
                "kl": _kl_view(traj, i, tokenizer),
            }
        )
    counts: dict[str, int] = {}
    for status in traj.tests.values():
        counts[status] = counts.get(status, 0) + 1
    flags = [
        {
            "rule": f.rule,
            "category": f.category,
            "severity": f.severity,
            "turn": f.turn,
            "evidence": _cut(f.evidence, MAX_EVIDENCE_CHARS)[0],
        }
        for f in traj.flags
    ]
    return {
        "id": index,
        "run": run,
        "step": step,
        "source": source,
        "task": traj.task_id,
        "reward": traj.reward,
        "reward_before_monitor": traj.info.get("reward_before_monitor"),
        "finish": traj.finish_reason,
        "tests": counts,
        "test_list": sorted(traj.tests.items())[:MAX_TESTS],
        "flags": flags,
        "max_severity": max((f.severity for f in traj.flags), default=None),
        "feedback": [{"turn": f.turn, "kind": f.kind, "hint": f.hint} for f in traj.feedback],
        "group": traj.info.get("group"),
        "sample": traj.info.get("sample"),
        "turns": turns,
    }


def select_trajectories(priorities: Sequence[int], limit: int) -> list[int]:
    """Which trajectories to embed: indices into ``priorities``, in their original order.

    ``priorities[i]`` ranks trajectory i: 0 flagged by the monitor, 1 hinted or carrying
    per-token KL, 2 plain. Up to ``limit`` are kept: a quarter of the budget is kept for plain
    episodes (a reader should see ordinary ones too), the rest goes to classes 0, then 1, then
    back to plain; within a class the picks are spread evenly over its list, so early, middle
    and late steps all appear.
    """
    if limit <= 0:
        return []
    if len(priorities) <= limit:
        return list(range(len(priorities)))
    classes = [[i for i, p in enumerate(priorities) if p == c] for c in range(3)]
    reserve = min(len(classes[2]), limit // 4)
    budget = limit - reserve
    take = []
    for c in (0, 1):
        take.append(min(len(classes[c]), budget))
        budget -= take[-1]
    take.append(min(len(classes[2]), reserve + budget))

    def spread(items: list[int], n: int) -> list[int]:
        if n >= len(items):
            return items
        if n == 1:
            return [items[len(items) // 2]]
        return [items[round(k * (len(items) - 1) / (n - 1))] for k in range(n)]

    return sorted(i for c in range(3) for i in spread(classes[c], take[c]))


VIEWER_HTML = """
<section id="viewer" class="card wide" data-trajectories="0" data-rendered="0">
  <h2>Trajectory viewer</h2>
  <p class="note" id="viewer-note"></p>
  <div class="controls">
    <label>run <select id="f-run"></select></label>
    <label>step <select id="f-step"></select></label>
    <label>task <select id="f-task"></select></label>
    <label>show <select id="f-kind">
      <option value="all">all</option>
      <option value="flagged">flagged</option>
      <option value="hinted">with hints</option>
      <option value="kl">with KL heat map</option>
      <option value="passed">passed (reward &gt;= 1)</option>
      <option value="failed">not passed</option>
    </select></label>
    <label>sort <select id="f-sort">
      <option value="step">step</option>
      <option value="reward-desc">reward, high first</option>
      <option value="reward-asc">reward, low first</option>
      <option value="flags">most severe flags</option>
      <option value="hints">most hints</option>
    </select></label>
    <span id="f-count" class="note"></span>
  </div>
  <div class="viewer-body">
    <div class="picker"><table id="traj-list"><thead><tr>
      <th>run</th><th>step</th><th>task</th><th>reward</th><th>turns</th><th>flags</th><th>hints</th>
    </tr></thead><tbody></tbody></table></div>
    <div id="traj-detail" class="detail" data-turns="0" data-kl-cells="0"></div>
  </div>
</section>
"""

VIEWER_CSS = """
.controls { display: flex; flex-wrap: wrap; gap: 10px 16px; align-items: center; margin: 8px 0 12px; }
.controls label { font-size: 13px; color: var(--muted); }
.controls select { margin-left: 4px; font: inherit; font-size: 13px; padding: 3px 6px;
  border: 1px solid var(--line); border-radius: 6px; background: #fff; max-width: 260px; }
.viewer-body { display: grid; grid-template-columns: 440px 1fr; gap: 16px; align-items: start; }
.picker { max-height: 860px; overflow: auto; border: 1px solid var(--line); border-radius: 8px; }
#traj-list { width: 100%; border-collapse: collapse; font-size: 12.5px; }
#traj-list th { position: sticky; top: 0; background: #f9fafb; text-align: left; padding: 6px;
  border-bottom: 1px solid var(--line); font-weight: 600; }
#traj-list td { padding: 5px 6px; border-bottom: 1px solid #f3f4f6; white-space: nowrap; }
#traj-list td.task { max-width: 150px; overflow: hidden; text-overflow: ellipsis; }
#traj-list tr { cursor: pointer; }
#traj-list tr:hover td { background: #f5f8ff; }
#traj-list tr.selected td { background: #e8efff; }
.detail { min-width: 0; }
.detail h3 { margin: 0 0 6px; font-size: 16px; }
.meta { display: flex; flex-wrap: wrap; gap: 6px 14px; font-size: 13px; color: var(--muted);
  margin-bottom: 10px; }
.meta b { color: var(--ink); font-weight: 600; }
.turn { border: 1px solid var(--line); border-left: 4px solid #d1d5db; border-radius: 8px;
  margin: 8px 0; padding: 8px 10px; background: #fff; }
.turn.system { border-left-color: #9ca3af; background: #fafafa; }
.turn.user { border-left-color: #6b7280; }
.turn.assistant { border-left-color: var(--run0); }
.turn.tool { border-left-color: #10b981; background: #fbfefc; }
.turn.hint { border-left-color: #f59e0b; background: #fffbeb; }
.turn.flagged { box-shadow: 0 0 0 1px #fecaca; }
.turn-head { display: flex; gap: 8px; align-items: baseline; font-size: 12px; color: var(--muted);
  margin-bottom: 4px; }
.turn-head .role { font-weight: 700; color: var(--ink); text-transform: uppercase;
  letter-spacing: .04em; font-size: 11px; }
.turn pre { margin: 4px 0 0; white-space: pre-wrap; word-break: break-word; font-size: 12.5px;
  line-height: 1.45; font-family: var(--mono); max-height: 420px; overflow: auto; }
.call { margin-top: 6px; font-size: 12.5px; }
.call code { font-family: var(--mono); background: #eef2ff; color: #3730a3; padding: 1px 5px;
  border-radius: 4px; }
.err { margin-top: 6px; font-size: 12.5px; color: #b91c1c; }
.badge { display: inline-block; font-size: 11px; padding: 1px 7px; border-radius: 999px;
  background: #f3f4f6; color: var(--ink); margin-right: 4px; }
.badge.sev3, .badge.sev4 { background: #fee2e2; color: #991b1b; }
.badge.sev2 { background: #ffedd5; color: #9a3412; }
.badge.sev1, .badge.sev0 { background: #f3f4f6; color: #374151; }
.badge.hint { background: #fef3c7; color: #92400e; }
.badge.pass { background: #d1fae5; color: #065f46; }
.badge.fail { background: #fee2e2; color: #991b1b; }
.flag { font-size: 12.5px; border: 1px solid #fecaca; background: #fff7f7; border-radius: 6px;
  padding: 6px 8px; margin: 6px 0; }
.flag pre { max-height: 160px; }
.heat { margin-top: 8px; font-family: var(--mono); font-size: 12.5px; line-height: 1.7;
  white-space: pre-wrap; word-break: break-word; }
.heat span.tok { border-radius: 2px; }
.heat-strip { display: flex; flex-wrap: wrap; gap: 1px; margin-top: 6px; }
.heat-strip span { width: 9px; height: 14px; border-radius: 2px; }
.heat-legend { font-size: 11.5px; color: var(--muted); margin-top: 4px; display: flex;
  align-items: center; gap: 6px; }
.heat-legend .ramp { width: 120px; height: 10px; border-radius: 3px;
  background: linear-gradient(90deg, rgba(220,38,38,0.03), rgba(220,38,38,0.85)); }
.tests { font-size: 12px; color: var(--muted); margin-top: 4px; }
"""

VIEWER_JS = r"""
function renderViewer(data) {
  const trajs = data.trajectories;
  const runs = data.runs.map(r => r.name);
  const $ = id => document.getElementById(id);
  const el = (tag, attrs, ...kids) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
      else e.setAttribute(k, v);
    }
    for (const k of kids) if (k !== null && k !== undefined) e.append(k);
    return e;
  };
  const fmt = v => (v === null || v === undefined) ? "-" : (Math.round(v * 1000) / 1000).toString();
  const option = (sel, value, label) => sel.append(el("option", {value: value, text: label}));
  const fill = (sel, values, label) => {
    option(sel, "", "all");
    for (const v of values) option(sel, String(v), label ? label(v) : String(v));
  };
  fill($("f-run"), runs.map((_, i) => i), i => runs[i]);
  const oneRun = runs.length < 2;
  if (oneRun) {
    $("f-run").parentElement.style.display = "none";
    document.querySelector("#traj-list thead th").style.display = "none";
  }
  fill($("f-step"), [...new Set(trajs.map(t => t.step).filter(s => s !== null))].sort((a, b) => a - b));
  fill($("f-task"), [...new Set(trajs.map(t => t.task))].sort());
  const hasKL = t => t.turns.some(u => u.kl);
  $("viewer-note").textContent = data.viewer_note;
  let selected = null;

  function visible() {
    const run = $("f-run").value, step = $("f-step").value, task = $("f-task").value;
    const kind = $("f-kind").value, sort = $("f-sort").value;
    let out = trajs.filter(t =>
      (run === "" || String(t.run) === run) && (step === "" || String(t.step) === step) &&
      (task === "" || t.task === task) &&
      (kind === "all" || (kind === "flagged" && t.flags.length > 0) ||
       (kind === "hinted" && t.feedback.length > 0) || (kind === "kl" && hasKL(t)) ||
       (kind === "passed" && (t.reward || 0) >= 1) || (kind === "failed" && (t.reward || 0) < 1)));
    const key = {
      "step": t => [t.run, t.step === null ? -1 : t.step, t.id],
      "reward-desc": t => [-(t.reward || 0), t.id],
      "reward-asc": t => [(t.reward || 0), t.id],
      "flags": t => [-(t.max_severity === null ? -1 : t.max_severity), -t.flags.length, t.id],
      "hints": t => [-t.feedback.length, t.id],
    }[sort];
    out.sort((a, b) => {
      const ka = key(a), kb = key(b);
      for (let i = 0; i < ka.length; i++) if (ka[i] !== kb[i]) return ka[i] < kb[i] ? -1 : 1;
      return 0;
    });
    return out;
  }

  function renderList() {
    const body = document.querySelector("#traj-list tbody");
    body.replaceChildren();
    const rows = visible();
    $("f-count").textContent = rows.length + " of " + trajs.length + " shown";
    for (const t of rows) {
      const flagCell = t.flags.length
        ? el("span", {class: "badge sev" + t.max_severity, text: t.flags.length + " (sev " + t.max_severity + ")"})
        : "";
      const tr = el("tr", {"data-id": String(t.id)},
        oneRun ? null : el("td", {text: runs[t.run]}), el("td", {class: "step", text: t.step === null ? (t.source.startsWith("eval_") ? "eval" : "-") : String(t.step)}),
        el("td", {class: "task", title: t.task, text: t.task}),
        el("td", {}, el("span", {class: "badge " + ((t.reward || 0) >= 1 ? "pass" : "fail"), text: fmt(t.reward)})),
        el("td", {text: String(t.turns.length)}), el("td", {}, flagCell),
        el("td", {}, t.feedback.length ? el("span", {class: "badge hint", text: String(t.feedback.length)}) : ""));
      if (selected === t.id) tr.classList.add("selected");
      tr.addEventListener("click", () => { selected = t.id; renderList(); renderDetail(t); });
      body.append(tr);
    }
  }

  function heatColor(v, max) {
    if (v === null || v === undefined) return "transparent";
    const a = max > 0 ? Math.min(1, v / max) : 0;
    return "rgba(220,38,38," + (0.03 + 0.82 * a).toFixed(3) + ")";
  }

  function renderKL(kl, turn) {
    const box = el("div", {class: "kl"});
    const max = Math.max(1e-12, ...kl.values.filter(v => v !== null));
    let cells = 0;
    if (kl.tokens) {
      const heat = el("div", {class: "heat"});
      kl.tokens.forEach((piece, i) => {
        const v = kl.values[i];
        const span = el("span", {class: "tok", text: piece,
          title: v === null ? "not a target token" : "KL " + v.toPrecision(3)});
        span.style.background = heatColor(v, max);
        if (v !== null) cells++;
        heat.append(span);
      });
      box.append(heat);
    } else {
      const strip = el("div", {class: "heat-strip"});
      kl.values.forEach((v, i) => {
        const cell = el("span", {title: "token " + i + ": " + (v === null ? "-" : "KL " + v.toPrecision(3))});
        cell.style.background = v === null ? "#f3f4f6" : heatColor(v, max);
        if (v !== null) cells++;
        strip.append(cell);
      });
      box.append(strip);
    }
    box.append(el("div", {class: "heat-legend"},
      "per-token KL on this hinted turn: 0", el("span", {class: "ramp"}), fmt(max) +
      " (mean " + fmt(kl.mean) + ", " + cells + " tokens" +
      (kl.tokens ? "" : "; no tokenizer in the run directory, tokens shown as cells") + ")"));
    return [box, cells];
  }

  function renderDetail(t) {
    const d = $("traj-detail");
    d.replaceChildren();
    const tests = Object.entries(t.tests).map(([k, v]) => v + " " + k).join(", ") || "no test results";
    d.append(el("h3", {text: t.task}));
    d.append(el("div", {class: "meta"},
      el("span", {}, "run ", el("b", {text: runs[t.run]})),
      el("span", {}, "step ", el("b", {text: t.step === null ? "-" : String(t.step)})),
      el("span", {}, "reward ", el("b", {text: fmt(t.reward)})),
      t.reward_before_monitor !== null && t.reward_before_monitor !== undefined && t.reward_before_monitor !== t.reward
        ? el("span", {}, "before monitor ", el("b", {text: fmt(t.reward_before_monitor)})) : null,
      el("span", {}, "finish ", el("b", {text: t.finish || "-"})),
      el("span", {}, "tests ", el("b", {text: tests})),
      el("span", {}, "source ", el("b", {text: t.source}))));
    if (t.test_list.length) {
      d.append(el("div", {class: "tests", text: t.test_list.map(([k, v]) => (v === "passed" ? "[pass] " : "[" + v + "] ") + k).join("   ")}));
    }
    for (const f of t.flags.filter(f => f.turn === null)) d.append(flagBox(f));
    const hintsAt = {};
    for (const f of t.feedback) (hintsAt[f.turn] = hintsAt[f.turn] || []).push(f);
    const flagsAt = {};
    for (const f of t.flags) if (f.turn !== null) (flagsAt[f.turn] = flagsAt[f.turn] || []).push(f);
    let klCells = 0;
    t.turns.forEach((u, i) => {
      for (const h of hintsAt[i] || []) {
        d.append(el("div", {class: "turn hint"},
          el("div", {class: "turn-head"}, el("span", {class: "role", text: "hint"}),
            el("span", {text: "spliced before turn " + i + " (teacher context only) - " + h.kind})),
          el("pre", {text: h.hint})));
      }
      const box = el("div", {class: "turn " + u.role + (flagsAt[i] ? " flagged" : ""), "data-turn": String(i)});
      const head = el("div", {class: "turn-head"}, el("span", {class: "role", text: u.role}),
        el("span", {text: "turn " + i}), u.tool_name ? el("span", {text: "from " + u.tool_name}) : null,
        u.num_tokens ? el("span", {text: u.num_tokens + " tokens" + (u.num_generated ? ", " + u.num_generated + " generated" : "")}) : null,
        u.cut ? el("span", {text: u.cut + " characters cut"}) : null);
      box.append(head, el("pre", {text: u.text}));
      for (const c of u.tool_calls) {
        box.append(el("div", {class: "call"}, "tool call ", el("code", {text: c.name}), " ",
          el("code", {text: JSON.stringify(c.arguments)})));
      }
      for (const e of u.errors) {
        box.append(el("div", {class: "err", text: "tool-call error " + e.kind + (e.tool ? " (" + e.tool + ")" : "") + ": " + e.message}));
      }
      if (u.kl) { const [node, n] = renderKL(u.kl, u); box.append(node); klCells += n; }
      for (const f of flagsAt[i] || []) box.append(flagBox(f));
      d.append(box);
    });
    d.dataset.turns = String(t.turns.length);
    d.dataset.klCells = String(klCells);
    d.dataset.trajectory = String(t.id);
  }

  function flagBox(f) {
    return el("div", {class: "flag"},
      el("span", {class: "badge sev" + f.severity, text: "severity " + f.severity}),
      el("b", {text: f.rule}), " " + f.category + (f.turn === null ? "" : " - turn " + f.turn),
      el("pre", {text: f.evidence}));
  }

  for (const id of ["f-run", "f-step", "f-task", "f-kind", "f-sort"]) $(id).addEventListener("change", renderList);
  const first = trajs.find(hasKL) || trajs.find(t => t.feedback.length) || trajs.find(t => t.flags.length) || trajs[0];
  if (first) { selected = first.id; renderDetail(first); }
  renderList();
  $("viewer").dataset.trajectories = String(trajs.length);
  $("viewer").dataset.rendered = "1";
}
"""
