"""Regenerate the templated head of ``specexec_hf/tools/data/prompts_train.jsonl`` (task templates x topics).

The training prompts only need to steer the target into the kinds of answers a chat model gives (explanations,
lists, code, stories, advice), so a deterministic template x topic product is enough. The held-out
``prompts_eval.jsonl`` is written by hand and shares no template with this file.

The hand-written prompts that follow the templated ones in the file are kept, renumbered after them.

Run: ``python scripts/make_train_prompts.py [--count 2400]``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[1] / "specexec_hf" / "tools" / "data" / "prompts_train.jsonl"
TEMPLATED_COUNT = 2400  # records written by this script at the head of OUTPUT; hand-written ones follow

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "the immune system", "climate change",
    "the French Revolution", "the Roman Empire", "ancient Egypt", "the Industrial Revolution", "the Cold War",
    "the printing press", "electric cars", "solar panels", "wind energy", "nuclear power", "recycling",
    "machine learning", "neural networks", "the internet", "cloud computing", "cybersecurity", "blockchain",
    "quantum computers", "smartphones", "video games", "social media", "remote work", "time management",
    "healthy sleep", "meditation", "running", "yoga", "vegetarian cooking", "baking bread", "coffee",
    "tea", "gardening", "houseplants", "dogs", "cats", "honeybees", "whales", "rainforests", "deserts",
    "the ocean", "the Moon", "Mars", "the solar system", "gravity", "magnets", "electricity", "light",
    "sound", "DNA", "vaccines", "antibiotics", "the human heart", "the brain", "nutrition", "vitamins",
    "saving money", "budgeting", "investing", "inflation", "taxes", "starting a small business", "marketing",
    "job interviews", "public speaking", "learning a language", "reading habits", "writing an essay",
    "chess", "football", "basketball", "the Olympics", "music theory", "the piano", "jazz", "painting",
    "photography", "movies", "poetry", "Shakespeare", "mythology", "democracy", "human rights",
    "friendship", "kindness", "moving to a new city", "travelling on a budget", "camping", "mountains",
    "rivers", "earthquakes", "weather forecasts", "airplanes", "trains", "bicycles", "robots",
    "3D printing", "databases", "Python programming", "JavaScript", "sorting algorithms", "recursion",
    "version control with git", "the Linux command line", "spreadsheets", "statistics", "probability",
    "fractions", "prime numbers", "geometry", "algebra", "calculus", "the Pythagorean theorem",
]

TEMPLATES = {
    "explain": [
        "Explain {t} in simple terms.",
        "What is {t}? Give a short explanation.",
        "Can you explain how {t} works to a ten-year-old?",
        "Give me a brief overview of {t}.",
        "Why is {t} important?",
        "What are the main ideas behind {t}?",
    ],
    "list": [
        "List five interesting facts about {t}.",
        "What are three common misconceptions about {t}?",
        "Give me a few tips for someone getting started with {t}.",
        "What are the pros and cons of {t}?",
        "Name some key terms related to {t} and define each one.",
    ],
    "writing": [
        "Write a short poem about {t}.",
        "Write a short story that involves {t}.",
        "Write a catchy slogan about {t}.",
        "Write a short paragraph introducing {t} for a school newsletter.",
        "Write a tweet about {t}.",
    ],
    "qa": [
        "I am curious about {t}. Where should I start?",
        "How has {t} changed over the last hundred years?",
        "What would happen if {t} did not exist?",
        "Compare {t} with something from everyday life.",
        "What questions do people often ask about {t}?",
    ],
    "teach": [
        "Create a short quiz with three questions about {t}.",
        "Make a simple study plan for learning about {t} in one week.",
        "Summarize the history of {t} in a few sentences.",
        "Describe {t} in exactly three sentences.",
    ],
}

CODING_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a sentence", "finds the largest number in a list",
    "removes duplicates from a list", "checks whether a word is a palindrome", "sorts a list of names",
    "converts Celsius to Fahrenheit", "merges two sorted lists", "computes the average of a list",
    "counts word frequencies in a text", "flattens a nested list", "checks whether two strings are anagrams",
    "computes the greatest common divisor of two numbers", "reads a file and prints its lines",
]
LANGUAGES = ["Python", "JavaScript", "C", "Java", "Rust", "Go"]

MATH_TEMPLATES = [
    "What is {a} plus {b}?",
    "What is {a} times {b}?",
    "If I have {a} apples and give away {b}, how many are left?",
    "A train travels {a} kilometers in {b} hours. What is its average speed?",
    "What is {a} percent of {b}?",
    "Solve for x: x + {a} = {b}.",
]


def build_prompts(count: int, seed: int) -> list[dict[str, str]]:
    """Every template x topic prompt plus coding and math prompts, shuffled and cut to ``count``.

    Args:
        count: How many prompts to keep.
        seed: Seed for the shuffle and for the numbers in math prompts.
    """
    rng = random.Random(seed)
    prompts = [
        {"category": category, "prompt": template.format(t=topic)}
        for category, templates in TEMPLATES.items()
        for template in templates
        for topic in TOPICS
    ]
    prompts += [
        {"category": "coding", "prompt": f"Write a {language} function that {task}."}
        for language in LANGUAGES
        for task in CODING_TASKS
    ]
    prompts += [
        {"category": "math", "prompt": template.format(a=rng.randint(2, 90), b=rng.randint(2, 90))}
        for template in MATH_TEMPLATES
        for _ in range(20)
    ]
    rng.shuffle(prompts)
    return [{"id": f"train-{index:05d}", **prompt} for index, prompt in enumerate(prompts[:count])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = [json.loads(line) for line in OUTPUT.read_text().splitlines() if line.strip()] if OUTPUT.exists() else []
    hand_written = [{k: v for k, v in record.items() if k != "id"} for record in records[TEMPLATED_COUNT:]]
    prompts = build_prompts(args.count, args.seed) + hand_written
    with OUTPUT.open("w") as handle:
        for index, prompt in enumerate(prompts):
            fields = {key: value for key, value in prompt.items() if key != "id"}
            handle.write(json.dumps({"id": f"train-{index:05d}", **fields}) + "\n")
    print(f"wrote {len(prompts)} prompts ({len(hand_written)} hand-written kept) to {OUTPUT}")


if __name__ == "__main__":
    main()
