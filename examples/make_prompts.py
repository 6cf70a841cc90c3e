"""Writes the demo dataset: ~300 varied, valid prompt rows for the demo and tests.

The file ships inside the package as ``datagen/data/prompts.jsonl`` (so ``datagen demo`` works from
any install); ``examples/prompts.jsonl`` is a symbolic link to it, for reading. This script is the
source of both. Deterministic (fixed seed, no downloads): run `python examples/make_prompts.py` and
the file comes out byte-identical.

Mix: partitions math / code / chat / reasoning / multilingual / tools, mostly short prompts, ~10% long
ones (pasted documents or code, a few thousand tokens; some marked "class": "long"), system prompts,
~10% multi-turn histories (some ending with an assistant turn to regenerate, some with reasoning in
earlier turns), unicode, function tools, ShareGPT and plain `prompt` rows, a few without ids.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

from datagen.prompts.dataset import Prompt, iter_prompts

SEED = 20251130
# The packaged copy; examples/prompts.jsonl links to it.
OUTPUT = Path(__file__).resolve().parent.parent / "datagen" / "data" / "prompts.jsonl"
N_MATH = 50
N_CODE = 45
N_CHAT = 52
N_REASONING = 35
N_MULTILINGUAL = 30
N_LONG_DOCS = 18
N_LONG_CODE = 12
N_MULTI_TURN = 32
N_SHAREGPT = 10
N_PLAIN = 10
N_WITHOUT_ID = 12

Row = dict[str, Any]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a meticulous math tutor. Show your reasoning step by step.",
    "You are a senior software engineer. Answer with idiomatic, well-tested code.",
    "Answer concisely. If you are unsure, say so.",
    "You are a friendly assistant who explains things to a curious twelve-year-old.",
    "Réponds toujours en français.",
    "你是一个乐于助人的助手。",
]

NAMES = ["Alice", "Bob", "Chen", "Dara", "Emeka", "Fatima", "Giulia", "Hiro", "Ingrid", "José"]
ITEMS = ["apples", "pencils", "marbles", "books", "stickers", "oranges", "coins", "cookies"]


def math_prompt(rng: random.Random) -> str:
    kind = rng.randrange(8)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if kind == 0:
        return f"What is {a} × {b} + {c}?"
    if kind == 1:
        total = c * c + a
        return f"{name} has {total} {item} and gives {c} of them to each of {c} friends. How many are left?"
    if kind == 2:
        return f"Solve for x: {c}x + {a} = {a + c * b}."
    if kind == 3:
        return f"Find all real roots of x^2 - {a + b}x + {a * b} = 0."
    if kind == 4:
        return f"Prove that the sum of the first {a} odd numbers is {a}^2."
    if kind == 5:
        return f"A train travels {a * 10} km in {c} hours. What is its average speed in m/s?"
    if kind == 6:
        return f"Compute the derivative of f(x) = {c}x^{c} · sin({b}x)."
    return f"How many positive divisors does {a * b * c} have? Explain briefly."


CODE_TASKS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring punctuation.",
    "Implement binary search in Rust and explain its complexity.",
    "Write a SQL query that returns the top 3 customers by total order value per country.",
    "Explain the difference between a process and a thread, with a short Go example.",
    "Write a bash one-liner that counts lines in all .py files under the current directory.",
    "Implement an LRU cache in Python without using functools.",
    "Write a TypeScript type that makes every property of an object deeply readonly.",
    "How do I read a large CSV file in chunks with pandas?",
    "Write a C function that reverses a singly linked list in place.",
    "Refactor this to a list comprehension: result = []\n"
    "for x in data:\n    if x % 2:\n        result.append(x * x)",
    "Why does this JavaScript print 3 three times?\n"
    "for (var i = 0; i < 3; i++) setTimeout(() => console.log(i));",
    "Write a Python async function that fetches several URLs concurrently with a limit of 5 at a time.",
    "Explain what a Bloom filter is and implement one in Python.",
    "Write unit tests with pytest for a function add(a, b).",
    'Convert this JSON to YAML:\n{"name": "demo", "ports": [8000, 9400], "debug": false}',
]
LANGS = ["Python", "Rust", "Go", "TypeScript", "Java", "C++", "Haskell"]
CODE_VERBS = [
    "parses ISO-8601 dates",
    "merges two sorted lists",
    "computes a moving average",
    "validates an email address",
    "flattens a nested list",
    "counts word frequencies",
]

CHAT_PROMPTS = [
    "What's a good name for a grey cat?",
    "Give me three tips for sleeping better.",
    "Write a haiku about autumn rain.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What should I pack for a weekend hiking trip?",
    "Explain how vaccines work in simple terms.",
    "Write a short, polite email declining a meeting invitation.",
    "What are the pros and cons of remote work?",
    "Recommend a few classic science-fiction novels.",
    "How do I make a good cup of pour-over coffee?",
    "Tell me a fun fact about octopuses 🐙",
    "Write a limerick about a programmer who hates semicolons.",
    "What is the difference between weather and climate?",
    "Plan a three-day itinerary for Kyoto.",
    "How can I politely ask my neighbour to turn the music down?",
]
TOPICS = [
    "black holes",
    "photosynthesis",
    "the French Revolution",
    "compound interest",
    "jazz",
    "machine learning",
    "plate tectonics",
    "the immune system",
    "blockchains",
    "origami",
]
STYLES = [
    "in one paragraph",
    "as a bulleted list",
    "for a five-year-old",
    "in exactly three sentences",
    "with an analogy",
    "like a pirate 🏴‍☠️",
]

REASONING_PROMPTS = [
    "If all bloops are razzies and all razzies are lazzies, are all bloops definitely lazzies?",
    "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball. How much is the ball?",
    "Three boxes are labelled apples, oranges and mixed, and every label is wrong. You may take one fruit "
    "from one box. How do you relabel them correctly?",
    "You have two ropes that each burn in exactly 60 minutes but unevenly. How do you measure 45 minutes?",
    "Which is heavier: a kilogram of feathers or a kilogram of steel? Explain.",
    "A farmer must cross a river with a wolf, a goat and a cabbage. How does he do it?",
    "If it takes 5 machines 5 minutes to make 5 widgets, how long do 100 machines take to make 100 widgets?",
    "Is the following argument valid? 'If it rains, the ground is wet. The ground is wet. So it rained.'",
]


def reasoning_prompt(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(REASONING_PROMPTS)
    n, k = rng.randint(3, 9), rng.randint(2, 4)
    people = ", ".join(rng.sample(NAMES, k))
    return (
        f"{people} sit around a round table with {n} seats. In how many distinct ways can they sit if "
        "rotations count as the same arrangement? Reason carefully."
    )


MULTILINGUAL_PROMPTS = [
    "请用三句话解释什么是量子纠缠。",
    "帮我写一首关于春天的五言绝句 🌸",
    "北京和上海哪个城市更适合旅游？为什么？",
    "¿Cuál es la diferencia entre «ser» y «estar»? Da ejemplos.",
    "Explique-moi la photosynthèse comme si j'avais dix ans, s'il te plaît.",
    "Was ist der Unterschied zwischen „Kaffee“ und „Café“ im Deutschen? ☕",
    "Как приготовить настоящий борщ? Перечисли ингредиенты.",
    "日本の四季について短く説明してください。🗾",
    "ما هي عاصمة المغرب، وما أشهر معالمها؟",
    "מה ההבדל בין ירושלים העתיקה לחדשה?",
    "भारत में दिवाली कैसे मनाई जाती है?",
    "Qual é a melhor época para visitar o Nordeste do Brasil? 🏖️",
    "Napisz krótki wiersz o jesieni w Krakowie.",
    "Türkçe'de ünlü uyumu nedir? Örneklerle açıkla.",
    "한국어로 간단한 자기소개 문장을 만들어 주세요 😊",
    "Translate to English: «Ça ne casse pas trois pattes à un canard.»",
    "Γράψε μια σύντομη περιγραφή της Ακρόπολης.",
    "Xin chào! Bạn có thể giới thiệu về phở không? 🍜",
]

DOC_SUBJECTS = [
    "the storage subsystem",
    "quarterly sales",
    "the migration plan",
    "customer support",
    "the data pipeline",
    "the hiring process",
    "network reliability",
    "the mobile app",
]
DOC_VERBS = [
    "improved",
    "regressed",
    "stabilised",
    "was redesigned",
    "was audited",
    "doubled",
    "was postponed",
    "exceeded expectations",
]
DOC_DETAILS = [
    "after the team replaced the legacy scheduler with a queue-based design",
    "because two of the largest customers renegotiated their contracts",
    "although the on-call rotation reported fewer pages than in the previous period",
    "while the backlog of open tickets fell by roughly a third",
    "once the new monitoring dashboards made the slow requests visible",
    "despite a week-long outage in one of the secondary regions",
    "as a result of stricter code review and better test coverage",
    "even though the budget was cut by ten percent at the start of the year",
]
LONG_ASKS = [
    "Summarize the document above in five bullet points.",
    "List every risk mentioned in the report above and rate each one.",
    "Write an executive summary of the report above for a non-technical audience.",
    "What are the three most important decisions this report asks for? Quote the relevant sentences.",
    "Find any contradictions in the document above.",
]


def long_document(rng: random.Random, paragraphs: int) -> str:
    parts = [f"# Internal report {rng.randint(1000, 9999)}: status of {rng.choice(DOC_SUBJECTS)}"]
    for p in range(paragraphs):
        sentences = []
        for _ in range(rng.randint(5, 8)):
            sentences.append(
                f"In period {p + 1}, {rng.choice(DOC_SUBJECTS)} {rng.choice(DOC_VERBS)} "
                f"{rng.choice(DOC_DETAILS)}, with a measured change of {rng.uniform(-30, 60):.1f}% "
                f"against a target of {rng.randint(5, 40)}%."
            )
        parts.append(f"## Section {p + 1}\n\n" + " ".join(sentences))
    return "\n\n".join(parts)


def long_code(rng: random.Random, functions: int) -> str:
    lines = ['"""Utility module pasted for review."""', "", "from __future__ import annotations", ""]
    for i in range(functions):
        name = f"{rng.choice(['load', 'parse', 'merge', 'score', 'render', 'check'])}_{rng.choice(ITEMS)}_{i}"
        limit = rng.randint(2, 50)
        lines += [
            "",
            f"def {name}(values: list[int], limit: int = {limit}) -> list[int]:",
            f'    """Return the values of {name.replace("_", " ")} that pass the limit check."""',
            "    result = []",
            "    for index, value in enumerate(values):",
            f"        if value % {rng.randint(2, 9)} == 0 and index < limit:",
            f"            result.append(value * {rng.randint(2, 9)})",
            "        elif value < 0:",
            "            raise ValueError(f'negative value at {index}: {value}')",
            "    return sorted(result)",
        ]
    return "\n".join(lines)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 'Paris'"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_web",
        "description": "Search the web and return the top results.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1}},
            "required": ["query"],
        },
    },
}
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def tool_rows() -> list[Row]:
    weather_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Lisbon", "unit": "celsius"}'},
    }
    return [
        {
            "partition": "tools",
            "tools": [WEATHER_TOOL],
            "messages": [{"role": "user", "content": "What's the weather in Oslo right now?"}],
        },
        {
            "partition": "tools",
            "tools": [WEATHER_TOOL, SEARCH_TOOL],
            "messages": [
                {"role": "system", "content": "You are an assistant that uses tools when they help."},
                {"role": "user", "content": "Find the latest news about the James Webb telescope."},
            ],
        },
        {
            "partition": "tools",
            "tools": [CALC_TOOL],
            "messages": [{"role": "user", "content": "What is 123456789 × 987654321 exactly?"}],
        },
        {
            "partition": "tools",
            "tools": json.dumps([SEARCH_TOOL]),
            "messages": [{"role": "user", "content": "Who won the Tour de France in 1998?"}],
        },
        {
            "partition": "tools",
            "tools": [WEATHER_TOOL],
            "messages": [
                {"role": "user", "content": "Should I take an umbrella in Lisbon today?"},
                {"role": "assistant", "content": "", "tool_calls": [weather_call]},
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": '{"temperature": 17, "condition": "light rain"}',
                },
            ],
        },
        {
            "partition": "tools",
            "tools": [WEATHER_TOOL, CALC_TOOL],
            "messages": [
                {"role": "user", "content": "Is it warmer in Cairo or in Reykjavík? By how many degrees?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Cairo"}},
                        },
                        {
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Reykjavík"}},
                        },
                    ],
                },
                {"role": "tool", "content": '{"temperature": 31}'},
                {"role": "tool", "content": '{"temperature": 4}'},
                {"role": "assistant", "content": "Cairo is 27 °C warmer than Reykjavík."},
            ],
        },
    ]


def multi_turn_row(rng: random.Random, index: int) -> Row:
    topic = rng.choice(TOPICS)
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS[:5])})
    turns = rng.randint(2, 4)
    for t in range(turns):
        question = (
            f"Tell me about {topic}."
            if t == 0
            else rng.choice(
                [
                    "Can you go deeper?",
                    "Give an example.",
                    "What are common misconceptions?",
                    "Summarize that in one line.",
                    "Why does that matter? 🤔",
                    "Any good books on this?",
                ]
            )
        )
        messages.append({"role": "user", "content": question})
        last = t == turns - 1
        if last and index % 2 == 0:
            break  # ends with a user turn: generate the next answer
        answer = f"Here is a short answer about {topic}, part {t + 1}."
        if rng.random() < 0.5:
            answer = f"<think>\nThe user asks about {topic}; keep it short.\n</think>\n\n{answer}"
        messages.append({"role": "assistant", "content": answer})
    if index % 5 == 1:  # a list-of-parts content form
        first_user = next(m for m in messages if m["role"] == "user")
        first_user["content"] = [
            {"type": "text", "text": first_user["content"]},
            {"type": "text", "text": "Be brief."},
        ]
    if index % 7 == 3:
        for m in messages:
            if m["role"] == "assistant" and "<think>" not in m["content"]:
                m["reasoning_content"] = f"The user wants to know about {topic}."
                break
    return {"partition": rng.choice(["chat", "reasoning"]), "messages": messages}


def single(partition: str, prompt: str, rng: random.Random, system_rate: float = 0.2) -> Row:
    messages = []
    if rng.random() < system_rate:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": prompt})
    return {"partition": partition, "messages": messages}


def short_rows(rng: random.Random) -> list[Row]:
    rows = [single("math", math_prompt(rng), rng) for _ in range(N_MATH)]
    for i in range(N_CODE):
        task = (
            CODE_TASKS[i]
            if i < len(CODE_TASKS)
            else f"Write a {rng.choice(LANGS)} function that {rng.choice(CODE_VERBS)}."
        )
        rows.append(single("code", task, rng))
    for i in range(N_CHAT):
        prompt = (
            CHAT_PROMPTS[i]
            if i < len(CHAT_PROMPTS)
            else f"Explain {rng.choice(TOPICS)} {rng.choice(STYLES)}."
        )
        rows.append(single("chat", prompt, rng))
    rows += [single("reasoning", reasoning_prompt(rng), rng) for _ in range(N_REASONING)]
    for i in range(N_MULTILINGUAL):
        rows.append(
            single(
                "multilingual",
                MULTILINGUAL_PROMPTS[i % len(MULTILINGUAL_PROMPTS)]
                + (
                    ""
                    if i < len(MULTILINGUAL_PROMPTS)
                    else f" ({rng.choice(['短く', 'brevemente', 'kurz', 'коротко'])})"
                ),
                rng,
            )
        )
    return rows


def long_rows(rng: random.Random) -> list[Row]:
    rows = []
    for i in range(N_LONG_DOCS):
        doc = long_document(rng, rng.randint(12, 30))
        row = single("chat" if i % 2 else "reasoning", f"{doc}\n\n{rng.choice(LONG_ASKS)}", rng)
        if i % 4 == 0:
            row["class"] = "long"
        rows.append(row)
    for i in range(N_LONG_CODE):
        code = long_code(rng, rng.randint(25, 60))
        ask = rng.choice(
            [
                "Review this module and point out bugs.",
                "Write pytest tests for the module above.",
                "Refactor the module above to remove the duplication.",
            ]
        )
        row = single("code", f"```python\n{code}\n```\n\n{ask}", rng)
        if i % 4 == 0:
            row["class"] = "long"
        rows.append(row)
    return rows


def other_form_rows(rng: random.Random) -> list[Row]:
    rows: list[Row] = []
    for i in range(N_SHAREGPT):
        conv = [{"from": "human", "value": rng.choice(CHAT_PROMPTS)}]
        if i % 3 == 0:
            conv.insert(0, {"from": "system", "value": rng.choice(SYSTEM_PROMPTS[:5])})
        if i % 2 == 1:
            conv += [{"from": "gpt", "value": "A reference answer that will be regenerated."}]
        rows.append({"partition": "chat", "conversations": conv})
    for i in range(N_PLAIN):
        row: Row = {
            "partition": "math" if i % 2 else "chat",
            "prompt": math_prompt(rng) if i % 2 else rng.choice(CHAT_PROMPTS),
        }
        if i % 3 == 0:
            row["system"] = rng.choice(SYSTEM_PROMPTS)
        rows.append(row)
    return rows


def build_rows() -> list[Row]:
    rng = random.Random(SEED)
    rows = short_rows(rng) + long_rows(rng) + other_form_rows(rng) + tool_rows()
    rows += [multi_turn_row(rng, i) for i in range(N_MULTI_TURN)]
    # The same conversation twice under two ids would be a duplicate training sample (and
    # `datagen report` flags identical sequences): keep the first of each.
    seen: set[str] = set()
    unique = []
    for row in rows:
        # Compare what the model sees: the row forms (messages, ShareGPT, prompt) normalized.
        [prompt] = iter_prompts(io.BytesIO(json.dumps(row).encode()))
        assert isinstance(prompt, Prompt), prompt
        content = json.dumps([prompt.messages, prompt.tools], sort_keys=True, ensure_ascii=False)
        if content not in seen:
            seen.add(content)
            unique.append(row)
    rows = unique
    rng.shuffle(rows)
    without_id = set(rng.sample(range(len(rows)), N_WITHOUT_ID))
    out = []
    for index, row in enumerate(rows):
        if index not in without_id:
            # most ids are strings, a few integers (both forms are accepted)
            row = {"id": index if index % 25 == 0 else f"ex-{index:04d}", **row}
        out.append(row)
    return out


def main() -> None:
    with OUTPUT.open("w", encoding="utf-8", newline="\n") as f:
        for row in build_rows():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
