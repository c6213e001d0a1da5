"""The exercises the tiny trained Qwen3 learns, each with one checkable answer, and its calculator tool.

A family makes one exercise from a random generator: the question, the working the model shows in
its <think> section, the answer line, and the expected value. `read_answer` takes a reply's answer
back out, so accuracy is a comparison, not a judgement:

    add        347 + 285         column by column from the right, each column's digits read off the question
                                 by place, the carry, and the result so far (`tens: 4 + 8 + 1 = 13 → 32, carry 1`)
    subtract   502 - 287         the same, with borrows
    repeat     42, 7, 19         copy the list (the easy family: every other one starts by copying)
    sort       42, 7, 19, 88     take the smallest of what is left, until nothing is
    convert    7 km to m         1 km = 1000 m, so multiply (append the zeros)
    tool       4821 * 37         too long to work by hand: call the calculator, then report its result

Every exercise has a `key` naming it regardless of phrasing; one key in ten is held out (`is_held_out`)
and never trained on, so the evaluation asks questions the model has not seen.
"""

import ast
import json
import operator
import random
import re
import zlib
from dataclasses import dataclass

HELD_OUT_EVERY = 10


@dataclass
class Exercise:
    family: str
    question: str
    working: str  # the reasoning, written into <think>...</think>
    answer: str  # the reply's content
    expected: int | tuple  # what read_answer must find in the content
    key: str  # the exercise without its phrasing: decides whether it is held out


def is_held_out(key: str) -> bool:
    """A fixed tenth of all exercises (by a hash of the key, the same on every machine)."""
    return zlib.crc32(key.encode()) % HELD_OUT_EVERY == 0


def number(rng: random.Random, digits: tuple[int, int]) -> int:
    n = rng.randint(*digits)
    return rng.randint(10 ** (n - 1) if n > 1 else 0, 10**n - 1)


PLACES = ["ones", "tens", "hundreds", "thousands", "ten-thousands"]


def digits(a: int, b: int) -> list[tuple[int, int, str]]:
    """(digit of a, digit of b, place name) from the ones up, the shorter number padded with zeros."""
    width = max(len(str(a)), len(str(b)))
    return [(a // 10**i % 10, b // 10**i % 10, PLACES[i]) for i in range(width)]


def make_add(rng: random.Random) -> Exercise:
    """Column addition read off the question by place (the digit just before the + is the ones of the first
    number), with the result so far written after each column: every step looks only a short, fixed way
    back, which a two-layer model learns far sooner than copying a whole number (docs/performance-history.md)."""
    a, b = number(rng, (2, 3)), number(rng, (1, 3))
    if rng.random() < 0.5:
        a, b = b, a
    lines, carry, so_far = [], 0, ""
    for x, y, place in digits(a, b):
        total = x + y + carry
        plus_carry = " + 1" if carry else ""
        carry, digit = divmod(total, 10)
        so_far = f"{digit}{so_far}"
        lines.append(f"{place}: {x} + {y}{plus_carry} = {total} → {so_far}" + (", carry 1" if carry else ""))
    if carry:
        lines.append(f"the carry 1 goes in front → 1{so_far}")
    lines.append(f"So the sum is {a + b}.")
    question = rng.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} = ?", "Add {a} and {b}.",
                           "What is the sum of {a} and {b}?"]).format(a=a, b=b)  # fmt: skip
    return Exercise("add", question, "\n".join(lines), f"{a} + {b} = {a + b}", a + b, f"add {min(a, b)} {max(a, b)}")


def make_subtract(rng: random.Random) -> Exercise:
    """Column subtraction the same way, borrowing from the next column."""
    a, b = sorted((number(rng, (2, 3)), number(rng, (1, 3))), reverse=True)
    lines, borrow, so_far = [], 0, ""
    for x, y, place in digits(a, b):
        minus_borrow = " - 1" if borrow else ""
        top = x - borrow
        if top < y:
            digit, step = top + 10 - y, f"{x}{minus_borrow} - {y} is below zero, borrow 10: {x + 10}{minus_borrow} - {y}"
            borrow = 1
        else:
            digit, step, borrow = top - y, f"{x}{minus_borrow} - {y}", 0
        so_far = f"{digit}{so_far}"
        lines.append(f"{place}: {step} = {digit} → {so_far}" + (", borrow 1" if borrow else ""))
    if len(so_far) > 1 and so_far.startswith("0"):
        lines.append(f"without the leading zeros → {a - b}")
    lines.append(f"So the difference is {a - b}.")
    question = rng.choice(["What is {a} - {b}?", "Compute {a} - {b}.", "{a} - {b} = ?", "What is {a} take away {b}?",
                           "What is {a} minus {b}?"]).format(a=a, b=b)  # fmt: skip
    return Exercise("subtract", question, "\n".join(lines), f"{a} - {b} = {a - b}", a - b, f"subtract {a} {b}")


def make_sort(rng: random.Random) -> Exercise:
    values = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    listed = ", ".join(map(str, values))
    lines, left = [f"The numbers: {listed}."], list(values)
    while len(left) > 1:  # the list left, then its smallest; the next line copies the list without it
        lines.append(f"smallest of {', '.join(map(str, left))}: {min(left)}")
        left.remove(min(left))
    lines.append(f"left: {left[0]}")
    ordered = sorted(values)
    lines.append(f"So the order is {', '.join(map(str, ordered))}.")
    question = rng.choice(["Sort these numbers from smallest to largest: {v}.", "Sort {v} in ascending order.",
                           "Put {v} in increasing order.", "Order from smallest to largest: {v}"]).format(v=listed)  # fmt: skip
    return Exercise("sort", question, "\n".join(lines), f"Sorted: {', '.join(map(str, ordered))}", tuple(ordered),
                    "sort " + " ".join(map(str, values)))  # fmt: skip


UNITS = [("km", "m", 1000), ("m", "cm", 100), ("cm", "mm", 10), ("kg", "g", 1000), ("L", "mL", 1000),
         ("m", "mm", 1000), ("t", "kg", 1000)]  # fmt: skip
ZEROS = {10: "one zero", 100: "two zeros", 1000: "three zeros"}


def make_convert(rng: random.Random) -> Exercise:
    big, small, factor = rng.choice(UNITS)
    value = number(rng, (1, 3))
    working = (f"1 {big} = {factor} {small}.\n{value} {big} = {value} * {factor} {small}: "
               f"append {ZEROS[factor]} to {value}, which gives {value * factor}.\nSo {value} {big} = {value * factor} {small}.")  # fmt: skip
    question = rng.choice(["Convert {v} {b} to {s}.", "How many {s} are in {v} {b}?", "What is {v} {b} in {s}?",
                           "{v} {b} = ? {s}"]).format(v=value, b=big, s=small)  # fmt: skip
    return Exercise("convert", question, working, f"{value} {big} = {value * factor} {small}", value * factor,
                    f"convert {value} {big} {small}")  # fmt: skip


def make_repeat(rng: random.Random) -> Exercise:
    """The easy family: copy a short list from the question. Every other family starts by copying numbers
    from the question, and copying (an induction head) is what a tiny model learns first when it is asked for."""
    values = [rng.randint(0, 999) for _ in range(rng.randint(2, 5))]
    listed = ", ".join(map(str, values))
    working = f"The numbers, in the order given: {listed}."
    question = rng.choice(["Repeat these numbers: {v}.", "Say {v} back to me.", "Copy this list: {v}",
                           "Write {v} again."]).format(v=listed)  # fmt: skip
    return Exercise("repeat", question, working, f"Repeated: {listed}", tuple(values), "repeat " + " ".join(map(str, values)))


FAMILIES = {"repeat": make_repeat, "add": make_add, "subtract": make_subtract, "sort": make_sort,
            "convert": make_convert}  # fmt: skip


def exercise(family: str, rng: random.Random, held_out: bool = False) -> Exercise:
    """An exercise of `family` from the training split, or from the held-out one."""
    while True:
        made = (make_tool_exercise if family == "tool" else FAMILIES[family])(rng)
        if is_held_out(made.key) == held_out:
            return made


def read_answer(family: str, content: str):
    """The answer a reply gives: the last integer of its content, or for sort every integer in order."""
    found = [int(n) for n in re.findall(r"-?\d+", content or "")]
    if family in ("sort", "repeat"):
        return tuple(found)
    return found[-1] if found else None


# The calculator the tool exercises call, declared to the model through the template's tools section.
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with +, - and *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 4821 * 37"}},
            "required": ["expression"],
        },
    },
}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int:
    """The calculator itself: integers, +, - and *, nothing else (no names, no calls); ValueError otherwise."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an arithmetic expression of integers: {expression!r}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from error


def make_tool_exercise(rng: random.Random) -> Exercise:
    """A product (or a long sum) too big to work by hand: the working decides to call the calculator."""
    if rng.random() < 0.7:
        a, b, op = number(rng, (3, 4)), number(rng, (2, 3)), "*"
    else:
        a, b, op = number(rng, (5, 6)), number(rng, (4, 6)), rng.choice("+-")
    expression = f"{a} {op} {b}"
    result = calculate(expression)
    question = rng.choice(["What is {e}?", "Compute {e}.", "Use the calculator: what is {e}?", "{e} = ?",
                           "Please work out {e}."]).format(e=expression)  # fmt: skip
    working = "The numbers are too long to work by hand, so I call the calculator."
    return Exercise("tool", question, working, f"{expression} = {result}", result, f"tool {expression}")


def tool_call_ok(message: dict, expected: int) -> tuple[bool, bool]:
    """(a well-formed calculator call was parsed, and its expression evaluates to the expected value)."""
    calls = message.get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "calculator":
        return False, False
    arguments = json.loads(calls[0]["function"]["arguments"])
    try:
        return True, calculate(str(arguments.get("expression", ""))) == expected
    except ValueError:
        return True, False
