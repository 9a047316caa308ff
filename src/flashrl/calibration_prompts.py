"""The built-in calibration prompts of `flashrl profile` (used when no --prompts file is given).

Short, varied texts in the styles an RL run meets: grade-school math, competition math, code,
instructions, dialogue, structured data, prose and a few non-English lines, so that every linear
layer sees a spread of activations. Written for flashrl; nothing is downloaded.
"""

from __future__ import annotations

CALIBRATION_PROMPTS: tuple[str, ...] = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
    "Solve for x: 3x + 7 = 22. Show your work and put the final answer after ####.",
    "Find all real numbers a such that the polynomial x^3 - ax^2 + 12x - 8 has three equal roots.",
    "What is 17 * 23? Answer: 17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 =",
    "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id GROUP BY",
    "User: Can you explain what a hash table is, in two sentences?\nAssistant:",
    "Summarize the following paragraph in one sentence: The committee met on Tuesday to discuss the budget. "
    "After a long debate, members agreed to fund the new library but postponed the decision on the park.",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP through",
    "{\"id\": 42, \"name\": \"widget\", \"tags\": [\"blue\", \"small\"], \"price\": 3.5, \"in_stock\": true,",
    "1. Preheat the oven to 180 C.\n2. Mix the flour, sugar and eggs.\n3.",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Das ist ein bekannter Satz, weil",
    "Prove that the sum of two even integers is even. Proof: Let a = 2m and b = 2n for integers m, n.",
)
"""16 prompts of 60-220 characters each."""
