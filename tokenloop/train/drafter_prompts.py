"""Chat prompts for self-distilling a drafter, written by the target model itself from seed topics.

No data set is downloaded or shipped: the model is asked to write one user request per (topic, ask) pair below,
its reply started for it ("Here is a question a user might ask about cooking pasta:\n\n\"").
The topics and asks are tokenloop's own text (the project's licence); what the model writes is its own output.
The same seed and model give the same prompts.
"""

from __future__ import annotations

import random
import re

from tokenloop.llm import LLM
from tokenloop.sampling.params import SamplingParams

SOURCE = "self-written: the target model asked to write one user request per seed topic (tokenloop's own text)"

TOPICS = (
    "cooking pasta", "baking bread", "healthy breakfasts", "vegetarian dinners", "coffee", "tea", "wine pairing",
    "home gardening", "houseplants", "composting", "dogs", "cats", "birds", "ocean life", "dinosaurs", "insects",
    "the solar system", "black holes", "the moon", "climate change", "volcanoes", "earthquakes", "weather forecasts",
    "rainforests", "deserts", "mountains", "rivers", "recycling", "renewable energy", "electric cars", "bicycles",
    "public transport", "air travel", "planning a trip to Japan", "visiting Paris", "camping", "hiking",
    "learning a language", "English grammar", "writing an essay", "poetry", "short stories", "famous novels",
    "Shakespeare", "ancient Rome", "ancient Egypt", "the Middle Ages", "World War II", "the Industrial Revolution",
    "world history", "geography", "capital cities", "elections", "economics", "inflation", "personal budgeting",
    "saving for retirement", "investing in stocks", "starting a small business", "marketing", "job interviews",
    "writing a resume", "working from home", "time management", "productivity", "public speaking", "negotiation",
    "leadership", "teamwork", "friendship", "parenting", "sleep", "exercise", "running", "yoga", "nutrition",
    "vitamins", "the human heart", "the brain", "the immune system", "first aid", "meditation", "stress",
    "music theory", "learning the guitar", "piano practice", "painting", "photography", "film history",
    "video games", "chess", "football", "basketball", "the Olympics", "mathematics", "fractions", "algebra",
    "geometry", "probability", "statistics", "calculus", "physics", "electricity", "magnets", "chemistry",
    "the periodic table", "biology", "evolution", "DNA", "cells", "photosynthesis", "computers", "the internet",
    "passwords and online safety", "smartphones", "artificial intelligence", "machine learning", "Python programming",
    "sorting algorithms", "recursion", "JavaScript", "web development", "databases", "SQL queries", "Linux",
    "Git", "debugging code", "writing unit tests", "data structures", "cloud computing", "spreadsheets",
    "email etiquette", "writing a thank-you note", "birthday parties", "wedding planning", "moving house",
    "cleaning tips", "home repairs", "buying a car", "philosophy", "ethics", "psychology", "habits", "motivation",
    "kindness", "holidays around the world", "myths and legends", "riddles", "jokes",
)  # fmt: skip

# (the user's instruction, the start of the model's reply): the reply is continued inside the opening quote, so the
# model writes a request in a user's voice and stops at the closing quote, rather than answering the instruction.
ASKS = (
    ("Write one question a user might ask an AI assistant about {topic}.", "Here is a question a user might ask"),
    (
        "Write one request a user might send to an AI assistant about {topic}: for an explanation, a list, advice, "
        "a short piece of writing or code.",
        "Here is a request a user might send",
    ),
    ("Write one question a curious beginner might ask about {topic}.", "Here is a question a beginner might ask"),
)
FALLBACK = "Tell me something interesting about {topic}."  # where the model writes nothing usable


def seed_tasks(num_prompts: int, seed: int) -> list[tuple[str, tuple[str, str]]]:
    """(topic, ask) pairs: every topic once per round, each round in its own (seed, round) order and with its ask."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    tasks: list[tuple[str, tuple[str, str]]] = []
    for round_ in range(-(-num_prompts // len(TOPICS))):
        order = list(TOPICS)
        random.Random(f"tokenloop.drafter_prompts {seed} {round_}").shuffle(order)
        tasks += [(topic, ASKS[(round_ + i) % len(ASKS)]) for i, topic in enumerate(order)]
    return tasks[:num_prompts]


def clean_request(text: str) -> str:
    """The first non-empty line of what the model wrote, without a "Question:" label or wrapping quotes."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    line = re.sub(r"^(\*\*)?(question|request|user)\s*\d*\s*:\s*(\*\*)?\s*", "", lines[0], flags=re.IGNORECASE)
    return line.strip().strip("\"'“”").strip()


def write_prompts(
    llm: LLM, num_prompts: int, seed: int = 0, max_tokens: int = 64, progress: bool = True
) -> tuple[list[str], int]:
    """num_prompts user requests written by the model, each inside the quote its reply was started with, sampled at
    temperature 0.8 with a seed per request (the same whatever the batch); and how many fell back to FALLBACK (the
    model wrote nothing usable)."""
    tasks = seed_tasks(num_prompts, seed)
    conversations = [
        [
            {"role": "user", "content": instruction.format(topic=topic)},
            {"role": "assistant", "content": f'{reply} about {topic}:\n\n"'},
        ]
        for topic, (instruction, reply) in tasks
    ]
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=seed * 1_000_003 + i, stop=['"', "\n"])
        for i in range(len(tasks))
    ]
    outputs = llm.chat(conversations, params, progress, add_generation_prompt=False, continue_final_message=True)
    prompts, fallbacks = [], 0
    for (topic, _), out in zip(tasks, outputs):
        request = clean_request(out.outputs[0].text)
        if len(request) < 8:
            request, fallbacks = FALLBACK.format(topic=topic), fallbacks + 1
        prompts.append(request)
    return prompts, fallbacks
