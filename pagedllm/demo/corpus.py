"""The demo tokenizer's training corpus: hand-written lines (prose, code, JSON, digits, many
scripts and emoji) plus deterministic template sentences."""

from __future__ import annotations

import json
import random

_WORDS = """
the a an this that these every some many few no one two three four five ten hundred thousand
time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story
fact month lot right study book eye job word business issue side kind head house service friend
father power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war history
party result change morning reason research girl guy moment air teacher force education model
engine memory cache block token request server client batch queue kernel tensor layer weight
river mountain forest garden ocean island village market bridge castle library museum station
be have do say go get make know think take see come want look use find give tell work call try
ask need feel become leave put mean keep let begin seem help talk turn start show hear play run
move like live believe hold bring happen write provide sit stand lose pay meet include continue
set learn lead understand watch follow stop create speak read allow add spend grow open walk win
offer remember love consider appear buy wait serve die send expect build stay fall cut reach
good new first last long great little own other old big high different small large next early
young important public bad same able quick brown lazy bright dark quiet loud warm cold gentle
and or but if because while when where after before since until although though so than
in on at by for with about against between into through during without under over above
quickly slowly carefully often never always sometimes usually really very quite almost
""".split()
_NAMES = "Alice Bob Carol Dave Eve Mallory Paris London Tokyo Berlin Monday Friday Python Linux".split()
_LINES = """The quick brown fox jumps over the lazy dog.
Once upon a time, in a village by the river, there lived an old clockmaker.
Paged attention stores the key-value cache in fixed-size blocks of sixteen tokens.
Continuous batching lets a finished request free its memory in the very next step.
What is the capital of France? The capital of France is Paris.
Please summarize the following article in three sentences.
I can't believe it's already Friday; the week went by so fast!
"Hello," she said. "How are you doing today?" He smiled and said nothing.
Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level.
The meeting is scheduled for 2024-03-15 at 09:30 UTC, in room B-204.
Call +1 (555) 867-5309 or email support@example.com for help.
Prices rose 3.5% in Q2, from $1,299.99 to $1,345.50 per unit.
def fibonacci(n: int) -> int:
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
import torch; x = torch.zeros((4, 16), dtype=torch.float32)
{"model": "pagedllm-demo", "messages": [{"role": "user", "content": "Hi!"}], "stream": true}
{"id": 42, "tags": ["a", "b"], "ok": false, "score": null, "ratio": 0.75}
SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;
<html><body><p class="note">Hello &amp; welcome</p></body></html>
Café, naïve, façade, résumé, jalapeño, Zürich, Ångström, smørrebrød.
Größe, Straße, Übung, Äpfel, Öl; ¿Dónde está la biblioteca? ¡Olé!
Ελληνικά: γειά σου κόσμε. Русский: привет, мир. Українська: дякую.
中文：你好，世界。日本語：こんにちは世界。한국어: 안녕하세요 세계.
עברית: שלום עולם. العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया.
Emoji: 😀 🚀 🎉 👍🏽 ❤️ 🇫🇷 — and symbols: © ® ™ € £ ¥ ° ± × ÷ ∑ √ ∞ ≤ ≥ →.
Tabs\tand  double  spaces, trailing spaces   , and a line with only digits: 0123456789.
""".replace("\\t", "\t").splitlines()


def _generated_lines(n: int, seed: int = 1234) -> list[str]:
    """Deterministic pseudo-English sentences, numbers and key/value snippets."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?,;:"))
        if i % 7 == 0:
            out.append(f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)} = {rng.randint(0, 10**rng.randint(1, 9))}")
        if i % 11 == 0:
            out.append(json.dumps({rng.choice(_WORDS): rng.random(), "n": rng.randint(-999, 999)}))
    return out


def corpus() -> list[str]:
    """The tokenizer training corpus (deterministic)."""
    return _LINES * 4 + _generated_lines(1500)
