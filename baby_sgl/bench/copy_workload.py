"""Copy-heavy chat workloads for speculative decoding (`bench offline --workload copy|multi-turn`):
tasks whose answers repeat text the model has already seen, as editing code, quoting a document,
filling JSON from a page and chats that come back to earlier answers do. The prompts go through
the model's chat template, so they only make sense for an instruction-tuned model (the default).
"""

from __future__ import annotations

from baby_sgl.bench.workloads import Workload

CODE = '''def summarize_orders(orders, min_total=0.0):
    """Totals per customer of the orders above min_total, largest first."""
    totals = {}
    for order in orders:
        if order["total"] < min_total:
            continue
        customer = order["customer"]
        totals[customer] = totals.get(customer, 0.0) + order["total"]
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    return [{"customer": name, "total": round(value, 2)} for name, value in ranked]


def load_orders(path):
    with open(path) as f:
        rows = [line.strip().split(",") for line in f if line.strip()]
    return [{"customer": row[0], "total": float(row[1])} for row in rows[1:]]
'''

PASSAGE = (
    "The harbour town woke slowly on market days. Fishermen unloaded their crates before sunrise, "
    "the bakers opened their shutters at six, and by eight the square was full of stalls selling "
    "bread, cheese, apples and rope. Children ran between the carts while their parents argued "
    "over prices, and an old man played the accordion by the fountain, the same three songs every "
    "week. At noon the church bell rang, the stalls closed one by one, and the gulls came down to "
    "take whatever had been left behind."
)

DOCUMENT = (
    "INVOICE 2291. Issued on 14 March 2025 by Northwind Supplies Ltd, 42 Canal Street, Leeds. "
    "Billed to: Marta Kowalska, Riverside Bakery, 7 Mill Lane, York. Items: 12 bags of flour at "
    "18.50 each, 4 boxes of yeast at 9.75 each, 2 mixing bowls at 24.00 each. Total due: 309.00 "
    "GBP, payable within 30 days to account 55-10-33 88123344."
)

TASKS = [
    f"Rename the function summarize_orders to total_by_customer in this code and output the whole "
    f"code, changed only there:\n\n{CODE}",
    f"Repeat the following passage word for word:\n\n{PASSAGE}",
    f"Here is a document:\n\n{DOCUMENT}\n\nCopy the invoice number, the date, the seller, the "
    f"customer's name and the total into a JSON object with those keys.",
    f"Fix the indentation of nothing and return this code exactly as it is:\n\n{CODE}",
]

# Questions several users ask, each in a chat of their own: a later user's answer repeats an
# earlier user's, which only the prefix cache's text (not the request's own) can draft.
QUESTIONS = [
    "What is a radix tree? Answer in three sentences.",
    "Give me a recipe for pancakes.",
    "Write a short poem about the sea.",
    "Explain what a hash map is to a beginner.",
]
USERS = ["You are a helpful assistant.", "You are a friendly assistant who answers briefly.",
         "You are an assistant for a programming course."]


def _chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def copy_workload(tokenizer, output_len: int, repeats: int = 1) -> Workload:
    prompts = [_chat(tokenizer, [{"role": "user", "content": t}]) for t in TASKS] * repeats
    return Workload("copy", prompts, [output_len] * len(prompts))


def multi_turn_workload(tokenizer, output_len: int) -> Workload:
    """Each user asks every question in turn (a fresh chat each), users one after another."""
    prompts = [_chat(tokenizer, [{"role": "system", "content": u}, {"role": "user", "content": q}])
               for u in USERS for q in QUESTIONS]
    return Workload("multi-turn", prompts, [output_len] * len(prompts))
