"""The personal facts a long-chat script plants and asks back (data for ``agent.lab.replay.longchat``).

Each fact is a clause the user drops as an aside ("my gym locker code is 4172"), a
*verbatim* question that reuses the fact's words, a *paraphrased* one that shares none of
its content words (so a cache that keeps tokens by surface overlap with the question gets
no help), and the strings a correct answer contains. The teacher-forced reply to a probe is
the clause turned to the second person (:func:`reply`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Fact:
    clause: str
    """The fact as a first-person clause, lower-case first word, no final stop."""
    verbatim: str
    paraphrased: str
    expect: tuple[str, ...]


FACTS: tuple[Fact, ...] = (
    Fact("my gym locker code is 4172", "What is my gym locker code?",
         "Which digits open the cabinet where I leave my things while I work out?", ("4172",)),
    Fact("my cat is called Purrnickel", "What is my cat called?", "What name did I give my feline?",
         ("Purrnickel",)),
    Fact("I grew up in Tromsø, in the north of Norway", "Where did I say I grew up?",
         "Where did I spend my childhood?", ("Tromsø", "Tromso")),
    Fact("my sister's name is Ilse", "What is my sister's name?", "What is my female sibling called?", ("Ilse",)),
    Fact("the wifi password at my cabin is maple-88", "What is the wifi password at my cabin?",
         "What do I type to get online at my place in the woods?", ("maple-88", "maple 88", "maple88")),
    Fact("my flight to Lisbon next week is TP 1843", "What is my flight number to Lisbon?",
         "Which plane am I catching to Portugal's capital?", ("1843",)),
    Fact("my favourite tea is lapsang souchong", "What is my favourite tea?", "Which brew do I like to drink most?",
         ("lapsang",)),
    Fact("I drive a green 1998 Volvo 240", "What car do I drive?", "What vehicle do I get around in?", ("Volvo",)),
    Fact("my bike lock combination is 9305", "What is my bike lock combination?",
         "Which numbers secure my bicycle?", ("9305",)),
    Fact("my daughter's violin teacher is Mrs. Okonkwo", "Who is my daughter's violin teacher?",
         "Who gives my girl her string lessons?", ("Okonkwo",)),
    Fact("my boat is named Saltfinch", "What is my boat named?", "What did I christen the vessel I sail?",
         ("Saltfinch",)),
    Fact("my employee ID is QX-5521", "What is my employee ID?", "Which number identifies me at work?", ("5521",)),
    Fact("I am allergic to hazelnuts", "Which food am I allergic to?", "What nut makes me sick?", ("hazelnut",)),
    Fact("my grandmother lives in a village called Oberwil", "What is the village my grandmother lives in called?",
         "Where is my nana's home?", ("Oberwil",)),
    Fact("I live in apartment 3B", "What is my apartment number?", "Which flat is mine?", ("3B",)),
    Fact("the dog I'm fostering is a greyhound named Biscotti", "What is the name of the dog I'm fostering?",
         "What do I call the hound staying with me for now?", ("Biscotti",)),
    Fact("my library card PIN is 6640", "What is my library card PIN?",
         "Which secret digits do I use to borrow books?", ("6640",)),
    Fact("my favourite composer is Hildegard von Bingen", "Who is my favourite composer?",
         "Whose music do I love best?", ("Hildegard",)),
    Fact("I parked in spot 112 of the garage", "Which spot of the garage did I park in?",
         "Where did I leave the car?", ("112",)),
    Fact("my brother lives in Valparaíso", "Where does my brother live?", "Which city is my male sibling based in?",
         ("Valparaíso", "Valparaiso")),
    Fact("my password hint is 'blue heron'", "What is my password hint?",
         "What clue did I pick to jog my memory for logging in?", ("heron",)),
    Fact("I call my fiddle-leaf fig Gustavo", "What do I call my fiddle-leaf fig?", "What is my houseplant's name?",
         ("Gustavo",)),
    Fact("the conference I'm organising is in Ljubljana", "Where is the conference I'm organising?",
         "In which city is the event I'm putting together?", ("Ljubljana",)),
    Fact("my old school was Ridgemont Academy", "What was my old school called?", "Where did I study as a kid?",
         ("Ridgemont",)),
    Fact("my landlord is Mr. Abernathy", "What is my landlord's name?", "Who do I pay rent to?", ("Abernathy",)),
    Fact("my car's licence plate is KV-392-T", "What is my car's licence plate?",
         "What is written on the registration tag of my vehicle?", ("392",)),
    Fact("I keep my spare key under the blue flowerpot", "Where do I keep my spare key?",
         "Where did I hide the backup for my front door?", ("flowerpot", "flower pot")),
    Fact("my team's project codename is Bluefin", "What is my team's project codename?",
         "What do we secretly call the thing my colleagues and I are building?", ("Bluefin",)),
    Fact("my favourite hiking trail is the Kungsleden", "What is my favourite hiking trail?",
         "Which long walk in the mountains do I like most?", ("Kungsleden",)),
    Fact("my piano is a 1962 Bösendorfer", "What make is my piano?",
         "Who built the instrument with the keys at my home?", ("Bösendorfer", "Bosendorfer")),
    Fact("my dentist appointment is on the 14th at 9:30", "When is my dentist appointment?",
         "What time do I have to be at the tooth doctor?", ("9:30",)),
    Fact("my niece's name is Thandiwe", "What is my niece's name?", "What is my sibling's little girl called?",
         ("Thandiwe",)),
    Fact("my favourite football club is Hajduk Split", "Which football club is my favourite?",
         "Which team do I cheer for on match days?", ("Hajduk",)),
    Fact("my mother's maiden name is Carvalho", "What is my mother's maiden name?",
         "What was mum's surname before she got married?", ("Carvalho",)),
    Fact("my favourite board game is Agricola", "What is my favourite board game?",
         "Which tabletop pastime do I enjoy most?", ("Agricola",)),
    Fact("my doctor is called Dr. Szymanski", "What is my doctor called?", "Which physician do I see?",
         ("Szymanski",)),
    Fact("my hotel room in Kyoto is number 586", "What is my hotel room number in Kyoto?",
         "Which door is mine at the place I'm staying in Japan?", ("586",)),
    Fact("my grandfather's watch is an Omega from 1957", "What brand is my grandfather's watch?",
         "Who made the timepiece my granddad left me?", ("Omega",)),
    Fact("my kayak is bright orange and called Zephyrine", "What is my kayak called?",
         "What name is painted on the little craft I paddle?", ("Zephyrine",)),
    Fact("my usual coffee order is a cortado with oat milk", "What is my usual coffee order?",
         "What do I normally get at the café?", ("cortado",)),
    Fact("the name of my band is The Velvet Lanterns", "What is the name of my band?",
         "What is our music group called?", ("Velvet Lantern",)),
    Fact("my first pet was a tortoise called Humphrey", "What was my first pet called?",
         "What was the name of the slow reptile I had as a child?", ("Humphrey",)),
    Fact("my bank branch is on Kestrel Street", "Which street is my bank branch on?",
         "Where do I go to sort out my money in person?", ("Kestrel",)),
    Fact("my ferry to the island leaves at 6:45", "When does my ferry to the island leave?",
         "What time is my boat across the water?", ("6:45",)),
    Fact("my favourite poet is Wisława Szymborska", "Who is my favourite poet?", "Whose verses do I admire most?",
         ("Szymborska",)),
    Fact("my childhood best friend was called Oriol", "What was my childhood best friend called?",
         "Who was my closest pal when I was little?", ("Oriol",)),
    Fact("my running club meets at Larchmont Park", "Where does my running club meet?",
         "Where do the joggers I train with gather?", ("Larchmont",)),
    Fact("my sourdough starter is called Doughbert", "What is my sourdough starter called?",
         "What name did I give the yeasty jar I bake bread with?", ("Doughbert",)),
)

STOPWORDS = frozenset("""
a an the is am are was were be been of to in on at by for from with and or but not no so as it its this that
these those there here what which where who whom whose when why how do does did done i i'm me my mine we our us
you your he she they them their his her have has had will would can could should about into over than then
just now some any all""".split())

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*(?:[-:][^\W_]+)*", re.UNICODE)


def content_words(text: str) -> set[str]:
    """Lower-cased words of three letters or more, possessive 's dropped, stop words removed."""
    out = set()
    for word in _WORD.findall(text.casefold()):
        word = re.sub(r"['’]s$", "", word)
        if len(word) >= 3 and word not in STOPWORDS:
            out.add(word)
    return out


_SWAP = {"my": "your", "i": "you", "i'm": "you're", "am": "are", "me": "you", "mine": "yours"}


def reply(fact: Fact) -> str:
    """The teacher-forced answer to a probe: the clause in the second person, as a sentence."""
    words = fact.clause.split(" ")
    out = [_SWAP.get(w.lower(), w) if w.lower() in _SWAP else w for w in words]
    text = " ".join(out)
    return text[0].upper() + text[1:] + "."
