"""Chat prompts for `tokenloop bench --speculative`: input-grounded work (the reply copies runs of the prompt,
which prompt lookup finds) and open-ended chat (it copies little)."""

PARAGRAPH = (
    "The river town of Alder Crossing grew up around a ferry that carried grain wagons across the water every "
    "morning. In 1871 a wooden bridge replaced the ferry, and within ten years the town had a mill, two schools, a "
    "newspaper and a railway station. The bridge burned in 1894, was rebuilt in stone the following year, and still "
    "stands today, although the mill closed in 1962 and the railway station is now a museum."
)

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over the given window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
'''

QUOTE = (
    '"It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, '
    "it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of "
    'Darkness, it was the spring of hope, it was the winter of despair."'
)

GROUNDED = [
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "Correct the spelling mistakes in this paragraph and return the whole corrected paragraph:\n\n"
    + PARAGRAPH.replace("replaced", "replacd").replace("newspaper", "newspapr").replace("museum", "musem"),
    f"Rewrite this Python function with one change: rename the parameter `values` to `numbers`. "
    f"Return the whole function.\n\n{CODE}",
    f"Quote this passage, then explain in one sentence what it means:\n\n{QUOTE}",
    f"Add a docstring line about the return type to this function and return the whole function:\n\n{CODE}",
]

OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying healthy while working from home?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me ideas for a weekend trip in the mountains.",
]
