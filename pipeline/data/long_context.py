"""A long-context prompt suite generated here, deterministically from a seed (no data set, nothing downloaded).

Each prompt is a generated document followed by a question that needs it, sized in the target tokenizer's tokens
(the chat template included, as ``chat_prompt_ids`` feeds the engine).  Three kinds of document take turns, so a
drafter's acceptance on the answers covers copying, code and prose:

    ledger     a stock ledger table (transaction id, date, warehouse, SKU, item, direction, quantity, unit price,
               approver); the question looks one transaction up, or asks for the total received of one SKU
    code       a Python module of many small helper functions; the question asks for a new function built on two of
               them, or for an explanation of one
    meetings   a month of team meeting notes with named people; the question asks what one person did over the
               month, or in one meeting

``build_suite(tokenizer, lengths, per_length, seed)`` -> ``{length: [row]}``, each row ``{"turns": [text], "id",
"prompt_tokens", "target_tokens", "kind", "question_type", "answer", "evidence"}``: ``prompt_tokens`` is the exact
chat-template token count, at most ``slack(target_tokens)`` (5 %, at least 64 tokens: about one table row or
function) below ``target_tokens`` = min(length, context_len - headroom) and never above it; ``evidence`` are
verbatim lines of the document the answer rests on, ``answer`` a string found in the document (for a ``total``
question: the sum of the evidence rows' quantities).  ``write_suite`` writes one ``long_context_<length>.jsonl`` per
length, in the ``{"turns": [...]}`` format every prompt reader here accepts.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path

from pipeline.core.file_lock import atomic_write_text
from pipeline.data.prompts import chat_prompt_ids

KINDS = ("ledger", "code", "meetings")
DEFAULT_CONTEXT = 8192  # the target's positions (SmolLM2-135M-Instruct as prepared here)
DEFAULT_HEADROOM = 512  # positions left free after the longest prompt: the completion and a verification block
TOLERANCE, MIN_SLACK = 0.05, 64  # a prompt is at most max(TOLERANCE * target, MIN_SLACK) tokens below its target

FIRST = ["Priya", "Tomás", "Amara", "Jonas", "Mei", "Oluwaseun", "Ingrid", "Rafael", "Keiko", "Dmitri", "Fatima",
         "Lukas", "Chloé", "Arjun", "Sofia", "Kwame", "Hannah", "Mateo", "Yuki", "Nadia", "Elif", "Owen", "Leila",
         "Bram", "Ana", "Samir", "Greta", "Theo", "Zanele", "Marek"]
LAST = ["Raman", "Okafor", "Lindqvist", "Castillo", "Nakamura", "Petrov", "Haddad", "Becker", "Moreau", "Iyer",
        "Rossi", "Mensah", "Schmidt", "Alvarez", "Sato", "Kowalski", "Nguyen", "Brennan", "Yilmaz", "Dubois",
        "Fischer", "Silva", "Kaur", "van Dijk", "Novak", "Osei", "Larsen", "Costa", "Hughes", "Tanaka"]
COMPANIES = ["Northwind Supplies", "Brightwater Tools", "Kestrel Logistics", "Alder & Finch", "Harbor Lane Foods",
             "Copperfield Instruments", "Bluestem Hardware", "Orchard Point Medical"]
ITEMS = ["Copper elbow 15mm", "Brass ball valve 22mm", "PVC pipe 40mm x 3m", "Steel bracket M8", "Cable gland M20",
         "LED panel 600x600", "Circuit breaker 16A", "Safety gloves L", "Hex bolt M10x40", "Washer M10 (100)",
         "Silicone sealant 310ml", "Pipe clamp 28mm", "Junction box IP65", "Twin cable 2.5mm 50m",
         "Thermostat valve", "Ceramic tile 30x30", "Wood screw 5x60 (200)", "Drill bit set HSS", "Ladder 3-step",
         "Work light 20W", "Extension lead 10m", "Paint roller 9in", "Masking tape 48mm", "Ear defenders",
         "Hi-vis vest XL", "Spirit level 600mm", "Angle grinder disc", "Cordless drill 18V", "Battery pack 4Ah",
         "Wall plug 8mm (100)", "Door hinge 100mm", "Cabinet handle 128mm", "Flexible hose 500mm", "Sink trap 40mm",
         "Fuse 13A (10)", "Smoke detector", "Copper tee 22mm", "Pressure gauge 0-10bar", "Insulation roll 100mm",
         "Gate valve 28mm"]
WAREHOUSES = ["WH-A", "WH-B", "WH-C", "WH-D", "WH-E"]
TEAMS = ["platform", "billing", "data engineering", "mobile", "customer support tooling", "logistics integration"]
SYSTEMS = ["the nightly export", "the billing cron job", "the search indexer", "the mobile release pipeline",
           "the warehouse sync", "the invoice renderer", "the payments webhook", "the staging cluster",
           "the reporting dashboard", "the label printer service", "the SSO login flow", "the backup job"]
PROBLEMS = ["failed twice because of an expired certificate", "ran forty minutes late after a schema change",
            "dropped about 2% of events during the upgrade", "hit the memory limit on the larger tenants",
            "sent duplicate notifications to twelve customers", "timed out while the database was being vacuumed",
            "showed stale numbers after the cache change", "stopped retrying after the library update"]
TASKS = ["write the rollback plan", "migrate the cron jobs to the new scheduler", "update the on-call runbook",
         "add an alert on the queue depth", "pair with the vendor on the API change", "draft the post-mortem",
         "benchmark the new instance type", "clean up the unused feature flags", "review the access audit",
         "prepare the quarterly cost report", "split the monolithic config file", "test the restore procedure",
         "rotate the service credentials", "document the data retention rules"]
ARTIFACTS = ["the design doc for the event bus", "the Q3 roadmap draft", "the load-test results",
             "the incident timeline", "the vendor contract renewal", "the new dashboard mock-ups",
             "the on-call rota", "the API deprecation notice", "the capacity forecast"]
METRICS = [("p95 latency", "ms"), ("error rate", "%"), ("weekly active users", "k"), ("support tickets", "per week"),
           ("build time", "min"), ("cloud spend", "kEUR per month")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


@dataclass
class _Doc:
    """A document as ordered chunks (rows / functions / note lines) to pack up to a token budget, and the question
    built from the chunks that were packed."""

    intro: str
    preamble: str
    sep: str
    chunks: list  # [(text, metadata dict)]
    question: Callable  # (included chunk metadata list, rng) -> (question, question_type, answer, evidence)
    structural: set = field(default_factory=set)  # chunk indices that must not be skipped (section headers)


# ---------------------------------------------------------------------------------------------------------- ledger
def _ledger(rng: random.Random) -> _Doc:
    company = rng.choice(COMPANIES)
    approvers = [f"{f[0]}. {l}" for f, l in zip(rng.sample(FIRST, 6), rng.sample(LAST, 6))]
    skus = {}
    for item in rng.sample(ITEMS, 28):
        skus[f"SKU-{rng.randint(1000, 9999)}"] = (item, round(rng.uniform(0.4, 180.0), 2))
    sku_ids = list(skus)
    day = date(2024, rng.randint(1, 6), 1)
    tx = rng.randint(1000, 60000)
    chunks = []
    for _ in range(400):
        tx += rng.randint(1, 9)
        day += timedelta(days=rng.choice([0, 0, 1, 1, 2]))
        sku = rng.choice(sku_ids)
        item, price = skus[sku]
        direction = rng.choices(["in", "out", "adj"], [4, 5, 1])[0]
        qty = rng.randint(1, 40) * (10 if price < 5 else 1)
        if direction == "adj":
            qty = -rng.randint(1, 6)
        unit = round(price * rng.uniform(0.97, 1.03), 2)
        row = {"tx": f"TX-{tx:05d}", "date": day.isoformat(), "wh": rng.choice(WAREHOUSES), "sku": sku, "item": item,
               "dir": direction, "qty": qty, "price": f"{unit:.2f}", "by": rng.choice(approvers)}
        text = (f"| {row['tx']} | {row['date']} | {row['wh']} | {sku} | {item} | {direction} | {qty} | {row['price']} "
                f"| {row['by']} |")
        chunks.append((text, dict(row, line=text)))

    def question(rows: list, qr: random.Random):
        counts = {}
        for r in rows:
            if r["dir"] == "in":
                counts[r["sku"]] = counts.get(r["sku"], 0) + 1
        multi = sorted(s for s, n in counts.items() if 2 <= n <= 8)
        if multi and qr.random() < 0.4:
            sku = qr.choice(multi)
            used = [r for r in rows if r["sku"] == sku and r["dir"] == "in"]
            total = sum(r["qty"] for r in used)
            q = (f"What is the total quantity of {sku} ({skus[sku][0]}) received (direction \"in\") over the whole "
                 f"ledger, across all warehouses? List the transactions you added up, then give the total.")
            return q, "total", str(total), [r["line"] for r in used]
        r = qr.choice(rows)
        q = (f"In the ledger above, which item, warehouse, direction, quantity and unit price does transaction "
             f"{r['tx']} record, and who approved it?")
        return q, "lookup", r["line"], [r["line"]]

    intro = (f"Below is the stock ledger of {company}. Each row is one transaction: id, date, warehouse, SKU, item, "
             f"direction (in = received, out = shipped, adj = stock-count correction), quantity, unit price in EUR "
             f"and the approver. Read it and answer the question after it.")
    preamble = ("| id | date | warehouse | SKU | item | direction | quantity | unit price | approved by |\n"
                "|---|---|---|---|---|---|---|---|---|")
    return _Doc(intro, preamble, "\n", chunks, question)


# ------------------------------------------------------------------------------------------------------------ code
_NOUNS = ["invoice", "shipment", "order", "customer", "supplier", "parcel", "pallet", "ticket", "voucher", "refund",
          "route", "batch", "sensor", "reading", "booking", "contract", "payment", "account", "warehouse", "driver"]
_FIELDS = ["amount", "weight", "distance", "duration", "quantity", "price", "score", "volume", "margin", "discount"]
_KEYS = ["region", "status", "channel", "category", "vendor", "currency", "team", "priority"]
_UNITS = [("kilograms", "pounds", 2.20462, "weight"), ("kilometres", "miles", 0.621371, "distance"),
          ("litres", "gallons", 0.264172, "volume"), ("metres", "feet", 3.28084, "length"),
          ("euros", "cents", 100.0, "amount"), ("hours", "minutes", 60.0, "duration"),
          ("megabytes", "kilobytes", 1024.0, "payload size"), ("tonnes", "kilograms", 1000.0, "load")]


def _function(rng: random.Random, used: set) -> tuple[str, dict] | None:
    noun, fld, key = rng.choice(_NOUNS), rng.choice(_FIELDS), rng.choice(_KEYS)
    kind = rng.randrange(8)
    if kind == 0:
        a, b, f, quantity = rng.choice(_UNITS)
        name = f"{noun}_{a}_to_{b}"
        body = (f"def {name}(value: float) -> float:\n"
                f"    \"\"\"Convert a {noun} {quantity} from {a} to {b}.\"\"\"\n"
                f"    return round(value * {f}, {rng.randint(1, 4)})")
        what = f"converts a {noun} {quantity} from {a} to {b}"
    elif kind == 1:
        w = rng.randint(4, 7)
        prefix = noun[:3].upper()
        name = f"normalize_{noun}_code"
        body = (f"def {name}(code: str) -> str:\n"
                f"    \"\"\"Upper-case a {noun} code and pad its number to {w} digits ('{prefix.lower()}-42' -> "
                f"'{prefix}-{42:0{w}d}').\"\"\"\n"
                f"    prefix, _, number = code.strip().partition(\"-\")\n"
                f"    return f\"{{prefix.upper()}}-{{int(number):0{w}d}}\"")
        what = f"normalises {noun} codes"
    elif kind == 2:
        name = f"{noun}s_over_{fld}"
        body = (f"def {name}(records: list[dict], limit: float) -> list[dict]:\n"
                f"    \"\"\"The {noun} records whose '{fld}' exceeds limit, largest first.\"\"\"\n"
                f"    hits = [r for r in records if r.get(\"{fld}\", 0) > limit]\n"
                f"    return sorted(hits, key=lambda r: r[\"{fld}\"], reverse=True)")
        what = f"filters {noun} records by {fld}"
    elif kind == 3:
        name = f"total_{fld}_by_{key}"
        body = (f"def {name}(records: list[dict]) -> dict[str, float]:\n"
                f"    \"\"\"Sum '{fld}' per '{key}' over the records.\"\"\"\n"
                f"    totals: dict[str, float] = {{}}\n"
                f"    for r in records:\n"
                f"        totals[r[\"{key}\"]] = totals.get(r[\"{key}\"], 0.0) + float(r[\"{fld}\"])\n"
                f"    return totals")
        what = f"sums {fld} per {key}"
    elif kind == 4:
        n = rng.randint(4, 8)
        prefix = noun[:2].upper()
        name = f"is_valid_{noun}_id"
        body = (f"def {name}(value: str) -> bool:\n"
                f"    \"\"\"True when value looks like a {noun} id: '{prefix}' followed by {n} digits.\"\"\"\n"
                f"    return bool(re.fullmatch(r\"{prefix}\\d{{{n}}}\", value))")
        what = f"validates {noun} ids"
    elif kind == 5:
        rate = rng.choice([0.05, 0.07, 0.09, 0.12, 0.15, 0.2, 0.21])
        tag = rng.choice(["fee", "surcharge", "tax", "levy"])
        name = f"apply_{noun}_{tag}"
        body = (f"def {name}(amount: float, rate: float = {rate}) -> float:\n"
                f"    \"\"\"Add the {noun} {tag} ({round(rate * 100)}% by default) to an amount, rounded to "
                f"cents.\"\"\"\n"
                f"    return round(amount * (1 + rate), 2)")
        what = f"adds the {noun} {tag}"
    elif kind == 6:
        days = rng.choice([7, 10, 14, 30, 45, 60])
        name = f"{noun}_due_date"
        body = (f"def {name}(start: date, days: int = {days}) -> date:\n"
                f"    \"\"\"The {noun} due date: start plus {days} days, moved to the next Monday on a "
                f"weekend.\"\"\"\n"
                f"    due = start + timedelta(days=days)\n"
                f"    while due.weekday() >= 5:\n"
                f"        due += timedelta(days=1)\n"
                f"    return due")
        what = f"computes {noun} due dates"
    else:
        name = f"group_{noun}s_by_{key}"
        body = (f"def {name}(records: list[dict]) -> dict[str, list[dict]]:\n"
                f"    \"\"\"The {noun} records grouped by '{key}', each group in input order.\"\"\"\n"
                f"    groups: dict[str, list[dict]] = defaultdict(list)\n"
                f"    for r in records:\n"
                f"        groups[r[\"{key}\"]].append(r)\n"
                f"    return dict(groups)")
        what = f"groups {noun} records by {key}"
    if name in used:
        return None
    used.add(name)
    return body, {"name": name, "noun": noun, "what": what, "signature": body.split("\n", 1)[0]}


def _code(rng: random.Random) -> _Doc:
    company = rng.choice(COMPANIES)
    module = rng.choice(["ops_helpers", "ledger_utils", "dispatch_tools", "billing_common", "fleet_support"])
    used: set = set()
    chunks = []
    while len(chunks) < 300 and len(used) < 1200:
        made = _function(rng, used)
        if made is not None:
            chunks.append(made)

    def question(funcs: list, qr: random.Random):
        if len(funcs) >= 2 and qr.random() < 0.6:
            a, b = qr.sample(funcs, 2)
            new = f"{a['noun']}_{b['noun']}_report"
            q = (f"Write a new function `{new}(records)` for this module that uses `{a['name']}` and `{b['name']}` "
                 f"(both defined above). Show the code, then explain in one sentence each what the two helpers do.")
            return q, "code", a["name"], [a["signature"], b["signature"]]
        a = qr.choice(funcs)
        q = (f"Explain what `{a['name']}` in the module above does, line by line, and give one example call with "
             f"its result.")
        return q, "explain", a["name"], [a["signature"]]

    intro = (f"Below is the module `{module}.py` of the {company} internal tooling. Read it and answer the request "
             f"after it.")
    preamble = (f"\"\"\"{module}: small helpers shared by the {company} back-office scripts.\"\"\"\n"
                "from __future__ import annotations\n\nimport re\nfrom collections import defaultdict\n"
                "from datetime import date, timedelta")
    return _Doc(intro, f"```python\n{preamble}", "\n\n", chunks, question)


# -------------------------------------------------------------------------------------------------------- meetings
def _gerund(task: str) -> str:
    """"write the plan" -> "writing the plan"."""
    verb, _, rest = task.partition(" ")
    if verb == "split":
        verb = "splitt"
    elif verb.endswith("e") and not verb.endswith("ee"):
        verb = verb[:-1]
    return f"{verb}ing {rest}"


def _meetings(rng: random.Random) -> _Doc:
    team = rng.choice(TEAMS)
    people = [f"{f} {l}" for f, l in zip(rng.sample(FIRST, 9), rng.sample(LAST, 9))]
    day = date(2024, rng.randint(1, 10), rng.randint(1, 5))
    chunks, structural = [], set()
    ticket = rng.randint(1000, 8000)
    for _ in range(60):
        day += timedelta(days=rng.choice([1, 2, 3, 4, 7]))
        while day.weekday() >= 5:  # meetings on working days
            day += timedelta(days=1)
        present = sorted(rng.sample(people, rng.randint(4, 7)))
        title = rng.choice(["weekly sync", "incident review", "planning", "retro", "stand-up", "vendor call"])
        structural.add(len(chunks))
        header = f"\n### {day.isoformat()} ({DAYS[day.weekday()]}), {title}\nAttendees: {', '.join(present)}"
        chunks.append((header, {"header": True, "date": day.isoformat()}))
        for who in rng.sample(present, min(len(present), rng.randint(3, 6))):
            other = rng.choice([p for p in present if p != who])
            ticket += rng.randint(1, 30)
            act = rng.randrange(6)
            if act == 0:
                text = f"reported that {rng.choice(SYSTEMS)} {rng.choice(PROBLEMS)} (OPS-{ticket})."
            elif act == 1:
                text = f"agreed to {rng.choice(TASKS)} by {rng.choice(DAYS)}."
            elif act == 2:
                text = f"reviewed {rng.choice(ARTIFACTS)} and asked {other} to {rng.choice(TASKS)}."
            elif act == 3:
                text = f"closed OPS-{ticket - rng.randint(5, 200)} after {_gerund(rng.choice(TASKS))}."
            elif act == 4:
                m, unit = rng.choice(METRICS)
                a, b = rng.randint(10, 900), rng.randint(10, 900)
                text = f"presented the {m} numbers: {a} {unit}, against {b} {unit} the week before."
            else:
                text = f"handed {_gerund(rng.choice(TASKS))} over to {other}."
            line = f"- {who}: {text}"
            chunks.append((line, {"who": who, "date": day.isoformat(), "line": line}))

    def question(items: list, qr: random.Random):
        notes = [m for m in items if not m.get("header")]
        by = {}
        for m in notes:
            by.setdefault(m["who"], []).append(m)
        often = sorted(w for w, ms in by.items() if len(ms) >= 2) or sorted(by)
        who = qr.choice(often)
        if qr.random() < 0.6:
            q = (f"Summarise what {who} did, reported or committed to across all the meetings above, in date order. "
                 f"Name the tickets and the people involved.")
            return q, "summary", who, [m["line"] for m in by[who]]
        m = qr.choice(by[who])
        q = f"In the meeting of {m['date']}, what did {who} report, do or agree to?"
        return q, "lookup", who, [m["line"]]

    intro = (f"Below are the notes of the {team} team's meetings. Each entry names who spoke and what they reported "
             f"or took on. Read them and answer the question after them.")
    return _Doc(intro, f"# {team.capitalize()} team, meeting notes", "\n", chunks, question, structural)


GENERATORS = {"ledger": _ledger, "code": _code, "meetings": _meetings}


# --------------------------------------------------------------------------------------------------------- packing
def _render(doc: _Doc, picked: list[int], rng_seed: str) -> tuple[str, str, str, list]:
    q, qtype, answer, evidence = doc.question([doc.chunks[i][1] for i in picked], random.Random(rng_seed))
    body = doc.sep.join([doc.preamble] + [doc.chunks[i][0] for i in picked])
    if doc.preamble.startswith("```"):
        body += "\n```"
    return f"{doc.intro}\n\n{body}\n\n---\n{q}", qtype, answer, evidence


def _pack(tokenizer, doc: _Doc, target: int, rng_seed: str) -> dict:
    """The chunks (in document order; a chunk that would overshoot is skipped, a section header that would ends the
    document) whose prompt, question included, comes closest to ``target`` tokens without exceeding it.  Chunk sizes
    estimate the length; the exact count of the whole chat-template prompt decides."""
    sizes = [len(x) for x in tokenizer([c for c, _ in doc.chunks], add_special_tokens=False)["input_ids"]]
    sep = len(tokenizer.encode(doc.sep, add_special_tokens=False))
    plain = [i for i in range(len(doc.chunks)) if i not in doc.structural]
    probe = list(range(plain[1] + 1))  # the first two entries (and their header): a question can be asked
    fixed = len(chat_prompt_ids(tokenizer, _render(doc, probe, rng_seed)[0])) - sum(sizes[i] + sep for i in probe)
    budget = target - fixed - 16  # questions differ in length by a few tokens
    picked, used = [], 0
    for i, n in enumerate(sizes):
        if used + n + sep <= budget:
            picked.append(i)
            used += n + sep
        elif i in doc.structural:
            break

    def count(ids):
        text, *rest = _render(doc, ids, rng_seed)
        return len(chat_prompt_ids(tokenizer, text)), (text, *rest)

    n, rendered = count(picked)
    while n > target and len(picked) > len(probe):
        picked.pop()
        while picked[-1] in doc.structural:  # no section header left without its entries
            picked.pop()
        n, rendered = count(picked)
    # fill what the estimate left: further entries after the last one packed, while they fit exactly
    tries = 0
    for i in range(picked[-1] + 1, len(sizes)):
        if n >= target * (1 - TOLERANCE / 2) or tries >= 24 or i in doc.structural:
            break
        if n + sizes[i] + sep > target:
            continue
        tries += 1
        m, r = count(picked + [i])
        if m <= target:
            picked, n, rendered = picked + [i], m, r
    if n > target:
        raise ValueError(f"a {target}-token prompt is too short for a document and its question ({n} tokens)")
    text, qtype, answer, evidence = rendered
    return {"turns": [text], "prompt_tokens": n, "target_tokens": target, "question_type": qtype, "answer": answer,
            "evidence": evidence}


def slack(target: int) -> int:
    """How far below its target a prompt may end (whole chunks do not fill a prompt to the token)."""
    return max(int(TOLERANCE * target), MIN_SLACK)


def target_tokens(length: int, context_len: int = DEFAULT_CONTEXT, headroom: int = DEFAULT_HEADROOM) -> int:
    """The prompt tokens a requested ``length`` stands for: at most context_len - headroom (an "8K" prompt of an
    8,192-position target is 7,680 tokens, leaving room for the completion)."""
    return min(int(length), int(context_len) - int(headroom))


def build_suite(tokenizer, lengths, per_length: int, seed: int = 0, context_len: int = DEFAULT_CONTEXT,
                headroom: int = DEFAULT_HEADROOM) -> dict[int, list[dict]]:
    """``per_length`` prompts of each of ``lengths`` (target tokens, chat template included), the document kinds
    taking turns; the same arguments and tokenizer give the same suite."""
    if per_length < 1:
        raise ValueError(f"per_length must be >= 1, got {per_length}")
    suite = {}
    for li, length in enumerate(lengths):
        target = target_tokens(length, context_len, headroom)
        if target < 256:
            raise ValueError(f"length {length}: {target} prompt tokens is too short for a document (>= 256)")
        rows = []
        for i in range(per_length):
            kind = KINDS[(li + i) % len(KINDS)]
            key = f"{seed}:{length}:{i}:{kind}"
            row = _pack(tokenizer, GENERATORS[kind](random.Random(key)), target, key + ":question")
            rows.append({"id": f"lc{length}-{i}-{kind}", "kind": kind, **row})
        suite[int(length)] = rows
    return suite


def suite_file(folder: str | Path, length: int) -> Path:
    return Path(folder) / f"long_context_{int(length)}.jsonl"


def write_suite(suite: dict[int, list[dict]], folder: str | Path) -> dict[int, Path]:
    """One JSONL file per length (``long_context_<length>.jsonl``), each written whole or not at all."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for length, rows in suite.items():
        out[length] = atomic_write_text(suite_file(folder, length),
                                        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return out
