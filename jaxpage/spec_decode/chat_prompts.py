"""Plain chat questions made from topics and question forms, in two disjoint splits: "train" (what an EAGLE-3
head is trained on, through the target's answers) and "held_out" (what its benchmark asks: other topics, other
forms). None asks to repeat or transform a given text, so no answer repeats its prompt."""
from __future__ import annotations

import itertools
import random

TOPICS = {
    "train": [
        "the water cycle", "photosynthesis", "volcanoes", "the French Revolution", "black holes", "honey bees",
        "the printing press", "climate change", "the human heart", "electric cars", "the Roman Empire", "coffee",
        "machine learning", "the moon landing", "rainforests", "chess", "the immune system", "plate tectonics",
        "the stock market", "vaccines", "the Great Wall of China", "recycling", "jazz music", "dinosaurs",
        "the internet", "earthquakes", "the Renaissance", "solar panels", "sleep", "the ocean tides",
        "ancient Egypt", "bicycles", "democracy", "gravity", "tea", "the Olympic Games", "penguins", "batteries",
        "the Industrial Revolution", "clouds", "bread baking", "the solar system", "libraries", "rainbows",
        "the piano", "glaciers", "friendship", "exercise", "the Amazon river", "robots",
    ],
    "held_out": [
        "lightning", "the Silk Road", "octopuses", "nuclear fusion", "origami", "the Vikings", "hurricanes",
        "chocolate", "the theory of evolution", "wind turbines", "meditation", "the Eiffel Tower", "bats",
        "the Cold War", "deserts", "coral reefs", "paper money", "comets", "gardening", "the violin",
    ],
}
FORMS = {
    "train": ["What is {}?", "Explain {} to a child.", "Give me three interesting facts about {}.",
              "Why is {} important?", "Write a short paragraph about {}.", "How does {} work?",
              "What are the main benefits and drawbacks of {}?", "Describe the history of {} briefly."],
    "held_out": ["Can you tell me about {}?", "Summarize what people should know about {}.",
                 "What would a beginner want to learn first about {}?", "Write a few sentences on {}."],
}


def chat_prompts(split: str, n: int, seed: int = 0) -> list[str]:
    """``n`` questions of ``split`` ("train" or "held_out"), each topic and form paired once before any repeats,
    in a seeded order."""
    pairs = [form.format(topic) for topic, form in itertools.product(TOPICS[split], FORMS[split])]
    random.Random(seed).shuffle(pairs)
    return [pairs[i % len(pairs)] for i in range(n)]
