"""The everyday requests, openers and reply styles of a varied-recall chat (data for ``recall_varied``).

A request is a question with a short scripted answer (two or three points), which the reply
styles shape differently: terse, chatty, bulleted, or a question back. Openers are a sentence
about something else that a message starts with, so a fact dropped after one sits
mid-message. None of this mentions a fact's value (the tests check it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    question: str
    points: tuple[str, ...]
    """The answer's points, most important first; each a sentence (a poem is one point: styles cut after any)."""
    follow_up: str
    """What a reply in the question-back style asks."""


REQUESTS: tuple[Request, ...] = (
    Request("How do I reverse a list in Python?",
            ("Use my_list.reverse() to flip it in place.", "Or my_list[::-1] for a reversed copy."),
            "do you need the original list kept intact"),
    Request("Any ideas for a twenty-minute dinner?",
            ("A vegetable stir-fry with rice.", "Pasta with garlic, chilli and spinach.", "An omelette with salad."),
            "are you cooking for one or for a crowd"),
    Request("Can you explain what a hash map is?",
            ("It stores values under keys.", "A hash of the key picks the slot, so lookups are fast on average."),
            "is this for an interview or for a project"),
    Request("What helps with falling asleep?",
            ("Keep the same bedtime every night.", "No screens for the last half hour.", "A cool, dark room."),
            "is it falling asleep or staying asleep that's hard"),
    Request("How do I centre a div in CSS?",
            ("Give the parent display: flex.", "Then justify-content: center and align-items: center."),
            "horizontally only, or both ways"),
    Request("Could you suggest a name for a bakery?",
            ("Rise & Shine.", "The Crumb Corner.", "Knead to Know."),
            "should it sound cosy or modern"),
    Request("Why is the sky blue?",
            ("Air scatters short blue wavelengths more than red ones.",
             "So blue light reaches us from all directions."),
            "do you want the physics or the one-line version"),
    Request("What does an HTTP 404 mean?",
            ("The server couldn't find the page you asked for.", "The server itself is reachable, though."),
            "are you seeing it on your own site"),
    Request("Write me a haiku about autumn, please.",
            ("Red leaves drift and turn / the cold wind hums through bare boughs / the year exhales slow.",),
            "would you like another one in a different mood"),
    Request("How do I convert Celsius to Fahrenheit?",
            ("Multiply by 9/5.", "Then add 32."),
            "do you want a quick mental shortcut too"),
    Request("What's a good stretch for a stiff neck?",
            ("Tilt your ear slowly towards your shoulder and hold for twenty seconds.", "Repeat on the other side."),
            "is the stiffness from sitting at a desk"),
    Request("What are git branches actually for?",
            ("They let you work on a change without touching the main line.", "You merge it back when it's ready."),
            "are you working alone or in a team"),
    Request("What's a healthy snack for the afternoon?",
            ("A handful of almonds.", "Apple slices with peanut butter.", "Plain yoghurt with berries."),
            "sweet or savoury"),
    Request("How does binary search work?",
            ("Look at the middle of a sorted list.", "Throw away the half that can't hold the target, and repeat."),
            "do you want it in code"),
    Request("What should I take on a weekend camping trip?",
            ("A tent, a sleeping bag and a mat.", "A stove, water and easy food.", "A torch and a rain layer."),
            "will you be near the car or hiking in"),
    Request("Is there a board game that works well for four people?",
            ("Ticket to Ride is easy to learn.", "Codenames is great for laughs.", "Azul if you like puzzles."),
            "are they competitive types"),
    Request("How long should I boil an egg for a runny yolk?",
            ("About six minutes from boiling.", "Then straight into cold water."),
            "are the eggs large or medium"),
    Request("How do I make coffee with a French press?",
            ("Coarse grounds, about a tablespoon per cup.", "Water just off the boil, steep four minutes, then press."),
            "do you take it black"),
    Request("What's the point of unit tests?",
            ("They catch regressions early.", "They document how code is meant to behave."),
            "are you starting a new codebase"),
    Request("How do I say no to a meeting politely?",
            ("Thank them for the invite.",
             "Say you can't make it and offer an alternative, like notes or a short call."),
            "is it with your manager"),
    Request("What is photosynthesis, in simple terms?",
            ("Plants use sunlight to turn water and carbon dioxide into sugar.", "Oxygen is released as a by-product."),
            "is this for a school project"),
    Request("Can you give me a short workout for the living room?",
            ("Three rounds of squats, push-ups and lunges.", "Ten of each, with a plank at the end."),
            "any injuries I should work around"),
    Request("How do I read a CSV file in Python?",
            ("import csv and open the file.", "csv.DictReader gives you each row as a dict."),
            "is pandas an option for you"),
    Request("What's a closure in programming?",
            ("A function that remembers the variables from where it was defined.",
             "Even after that outer function has returned."),
            "which language are you using"),
    Request("How do I keep basil alive indoors?",
            ("Lots of light — a sunny windowsill.", "Water when the top of the soil is dry.", "Pinch off flower buds."),
            "is it a supermarket pot"),
    Request("What is compound interest?",
            ("Interest earned on your interest as well as the original sum.", "It grows faster the longer it runs."),
            "are you thinking about savings or a loan"),
    Request("How can I cut down my screen time?",
            ("Turn off non-essential notifications.", "Keep the phone out of the bedroom.", "Set app limits."),
            "is it mostly the phone"),
    Request("What causes thunder?",
            ("Lightning heats the air suddenly.", "The air expands so fast it makes a shock wave we hear."),
            "curious, or did a storm keep you up"),
    Request("Tell me a fun fact about octopuses.",
            ("They have three hearts.", "And blue blood."),
            "want another one"),
    Request("How do I make a simple tomato sauce?",
            ("Soften garlic in olive oil.", "Add a tin of tomatoes and simmer twenty minutes.", "Season at the end."),
            "is it for pasta or pizza"),
    Request("What's the difference between a process and a thread?",
            ("A process has its own memory.", "Threads share their process's memory."),
            "is this about Python specifically"),
    Request("Any tips for writing clearer emails?",
            ("Put the ask in the first line.", "Keep it short.", "One topic per email."),
            "who's the audience"),
    Request("How do I remove duplicates from a list in Python?",
            ("list(dict.fromkeys(items)) keeps the order.", "set(items) is fine if order doesn't matter."),
            "does the order matter to you"),
    Request("How should I start learning a new language?",
            ("Fifteen minutes a day beats a long session once a week.", "Learn the most common words first."),
            "which language"),
    Request("What's the difference between weather and climate?",
            ("Weather is what happens today.", "Climate is the pattern over decades."),
            "for a school question or just curious"),
)

OPENERS: tuple[str, ...] = (
    "Busy week so far — the kitchen tap started dripping on Monday and I still haven't called anyone.",
    "Sorry for the long message, I'm typing this on the bus.",
    "Today was one of those days where everything took twice as long as planned.",
    "So the neighbours are renovating again and the drilling starts at eight sharp.",
    "I've been trying to be more organised lately, with mixed results.",
    "It's been raining nonstop here, which has wrecked my plans for the garden.",
    "Just got back from the supermarket, where they'd moved every aisle around.",
    "My phone died halfway through the afternoon, so I'm catching up on everything now.",
    "Long day at work — three meetings that could have been emails.",
    "Weekend was lovely but far too short, as always.",
    "I finally cleared out the hallway cupboard and found things I'd forgotten I owned.",
    "The heating packed in last night, so I'm wrapped in two jumpers as I write this.",
    "We had friends over yesterday and the flat still looks like a hurricane went through.",
    "I started a new notebook for to-do lists, which feels very grown-up.",
    "Slow start this morning — I overslept and skipped breakfast.",
)

GREETINGS: tuple[str, ...] = (
    "Hi! Bit of a ramble before my actual question.",
    "Hello there. Let me give you some context first.",
    "Hey!",
    "Hi, hope you don't mind a chatty start.",
)

CONNECTIVES: tuple[str, ...] = ("Anyway,", "But my real question:", "So,", "Right, what I wanted to ask:", "")

PROBE_FRAMES: tuple[str, ...] = (
    "{q}",
    "Quick one — {q}",
    "Sorry, my memory is shot today. {q}",
    "Random, but: {q}",
    "Going back to something from before — {q}",
)


def _lower_first(text: str) -> str:
    # An acronym ("HTTP …") keeps its capitals.
    return text if text[1:2].isupper() else text[:1].lower() + text[1:]


def ask(request: Request, connective: str) -> str:
    """The request as the end of a longer message (after an opener or an aside)."""
    return f"{connective} {_lower_first(request.question)}" if connective else request.question


def reply(request: Request, rng: random.Random) -> str:
    """A scripted answer to ``request`` in one of four styles."""
    # Terse twice as often as each other style: keeps a chat near recall30's ~1.2k tokens.
    style = max(rng.randrange(5) - 1, 0)
    if style == 0:
        return request.points[0]
    if style == 1:
        lead = rng.choice(("Oh, good one!", "Happy to help.", "Sure thing!", "Ah, a classic."))
        tail = rng.choice(("Hope that helps!", "Let me know how it goes.", "Anything else on your mind?"))
        # Two points at most: the chatty wrapper already makes this the longest style.
        return f"{lead} {' '.join(request.points[:2])} {tail}"
    if style == 2:
        return "\n".join(f"- {p}" for p in request.points)
    return f"Short version: {_lower_first(request.points[0])} Before I go further — {request.follow_up}?"


def probe_reply(text: str, rng: random.Random) -> str:
    """A scripted answer to a probe: states ``text`` in one of four styles."""
    return rng.choice((f"{text}.", f"You mentioned it earlier — {text}.", f"- {text}",
                       f"That would be {text}. Want me to remind you of anything else?"))
