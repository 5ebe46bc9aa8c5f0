"""Training prompts written for this project: task templates x topics, deterministic.

Self-distillation needs prompts, not answers (the base model writes the answers). These cover
the kinds of requests a chat model serves (writing, explanation, reasoning, math, code,
extraction, translation, summarising, advice), and are deliberately *not* taken from Spec-Bench,
which is kept for evaluation only.
"""

from __future__ import annotations

import random

TEMPLATES = [
    "Write a short story about {t}.",
    "Write a poem about {t}.",
    "Explain {t} to a ten-year-old.",
    "What are the main advantages and disadvantages of {t}?",
    "Give me five interesting facts about {t}.",
    "Write a blog post introduction about {t}.",
    "Describe the history of {t} in a few paragraphs.",
    "How would you teach a beginner about {t}? Give a step-by-step plan.",
    "Write a persuasive paragraph arguing that everyone should learn about {t}.",
    "Compare {t} and {u}. How are they similar and how are they different?",
    "Write an email to a friend recommending {t}.",
    "List three common misconceptions about {t} and correct them.",
    "Pretend you are a tour guide and describe {t} to visitors.",
    "What questions would an expert ask about {t}? Answer two of them.",
    "Summarize what you know about {t} in three sentences.",
    "Write a dialogue between two people discussing {t}.",
    "Create a short quiz with answers about {t}.",
    "What is the future of {t}? Make three predictions.",
    "Write a product description for something related to {t}.",
    "Give practical tips for someone interested in {t}.",
]

TOPICS = [
    "the ocean", "volcanoes", "honey bees", "the moon landing", "electric cars", "photosynthesis", "the Roman Empire",
    "chess", "climate change", "machine learning", "the human heart", "black holes", "coffee", "the printing press",
    "renewable energy", "origami", "the immune system", "ancient Egypt", "recycling", "jazz music", "mountain climbing",
    "the internet", "dinosaurs", "gardening", "the stock market", "rainforests", "vaccines", "the French Revolution",
    "bicycles", "solar panels", "penguins", "the Olympic Games", "baking bread", "quantum computers", "deserts",
    "public libraries", "earthquakes", "the Silk Road", "robots", "meditation", "coral reefs", "the theory of evolution",
    "smartphones", "the water cycle", "Shakespeare", "space telescopes", "trains", "friendship", "board games",
    "the Great Wall of China", "wolves", "nutrition", "3D printing", "hurricanes", "the piano", "cryptography",
]

MATH = [
    "What is {a} multiplied by {b}? Show your work.",
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost in dollars?",
    "If a train travels {a} kilometers in {b} hours, what is its average speed?",
    "Solve for x: {a}x + {b} = {c}.",
    "What is the sum of all integers from 1 to {a}?",
    "A rectangle is {a} meters long and {b} meters wide. What are its area and perimeter?",
    "Is {c} a prime number? Explain how you checked.",
    "Convert {a} degrees Celsius to Fahrenheit.",
]

CODE = [
    "Write a Python function that {task}.",
    "Explain what this does and suggest an improvement: a Python function that {task}.",
    "Write a JavaScript function that {task}, with a short usage example.",
    "How would you test a function that {task}? Write the tests in Python.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence", "merges two sorted lists",
    "finds the largest element of a list", "computes the factorial of n", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "returns the n-th Fibonacci number", "checks whether a string is a palindrome",
    "sorts a list of dictionaries by a key", "reads a CSV file and sums a column",
]

SENTENCES = [
    "The weather is beautiful today and the children are playing in the park.",
    "Please send me the report before Friday afternoon.",
    "Learning a new language takes patience and practice.",
    "The museum opens at nine o'clock every morning except Monday.",
    "My grandmother bakes the best apple pie in the village.",
    "We missed the last bus, so we walked home under the stars.",
    "Technology changes quickly, but good habits last a lifetime.",
    "The library has thousands of books about history and science.",
]

TRANSLATE = [
    "Translate into French: {s}",
    "Translate into German: {s}",
    "Translate into Spanish: {s}",
    "Rewrite this sentence in a more formal tone: {s}",
    "Correct any mistakes and explain the grammar of this sentence: {s}",
]


def training_prompts(count: int = 400, seed: int = 0) -> list[str]:
    """``count`` distinct prompts, the same for the same seed."""
    rng = random.Random(seed)
    pool: list[str] = []
    for template in TEMPLATES:
        for topic in TOPICS:
            other = TOPICS[(TOPICS.index(topic) + 7) % len(TOPICS)]
            pool.append(template.format(t=topic, u=other))
    for template in MATH:
        for a in (3, 12, 17, 25, 48, 120):
            pool.append(template.format(a=a, b=a % 7 + 4, c=a * 3 + 1))
    for template in CODE:
        pool += [template.format(task=task) for task in CODE_TASKS]
    for template in TRANSLATE:
        pool += [template.format(s=s) for s in SENTENCES]
    pool = sorted(set(pool))
    rng.shuffle(pool)
    return pool[:count]
