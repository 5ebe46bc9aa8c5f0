"""Training prompts written for this project: templates x fillers, 1828 distinct, deterministic.

Self-distillation needs prompts, not answers (the base model writes the answers). These cover
the kinds of requests a chat model serves (writing, explanation, factual questions, roleplay,
word problems and puzzles, code, translation both ways, passages to summarise, extract from and
ask about, advice), and are deliberately *not* taken from Spec-Bench, which is kept for
evaluation only; ``assets/calibration_prompts.jsonl`` holds prompts disjoint from these.
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


QUESTIONS = [
    "Where is {place} located?", "What is {place} famous for?", "What language do people speak in {place}?",
    "What is the climate like in {place}?", "Name three things a visitor should see in {place}.",
]

PLACES = [
    "Patagonia", "the Sahara", "Kyoto", "Lake Baikal", "Iceland", "the Amazon basin", "Mount Kilimanjaro", "Tasmania",
    "the Alps", "Madagascar", "Istanbul", "the Atacama Desert", "Scotland", "Lake Titicaca", "the Himalayas", "Cape Town",
    "Vancouver", "the Galapagos Islands", "Prague", "Mongolia", "the Dead Sea", "New Zealand", "Bavaria", "Havana",
]

FACTS = [
    "Who invented {thing}?", "When was {thing} invented, and why did it matter?", "How does {thing} work?",
    "What problem did {thing} solve?",
]

THINGS = [
    "the telephone", "the steam engine", "the light bulb", "the compass", "paper", "the microscope", "the radio",
    "the airplane", "penicillin", "the transistor", "the World Wide Web", "the mechanical clock", "glass lenses",
    "the refrigerator", "the bicycle", "concrete", "the battery", "the camera", "the sewing machine", "the vaccine",
]

PERSONAS = [
    "a pirate captain", "a medieval knight", "a grumpy librarian", "an astronaut on the space station", "a famous chef",
    "a detective from the 1920s", "a wise old wizard", "a cheerful kindergarten teacher", "a marine biologist",
    "a time traveller from the year 3000", "a sports commentator", "a Shakespearean actor",
]

PERSONA_ASKS = [
    "What is your opinion on umbrellas?", "Describe your typical morning.", "Give me advice about saving money.",
    "What do you think of modern music?", "Tell me about the hardest day of your life.", "How should I prepare for a job interview?",
    "What is the most important lesson you have learned?", "Recommend a good book and explain why.",
]

WORD_PROBLEMS = [
    "{name} buys {a} boxes of apples. Each box holds {b} apples and costs ${c}. How many apples does {name} have, and how much did they cost?",
    "{name} reads {a} pages every day. The book has {p} pages. How many days does it take to finish the book?",
    "A farmer has {a} cows and {b} chickens. How many legs are there on the farm in total?",
    "{name} saves ${a} each week. How many weeks until {name} can buy a bicycle that costs ${p}?",
    "A class has {p} students. {a} percent of them walk to school. How many students walk to school?",
    "{name} ran {a} kilometers on Monday and {b} kilometers more on Tuesday than on Monday. How far did {name} run on both days?",
    "A bakery makes {p} cookies and packs them in bags of {b}. How many full bags are there and how many cookies are left over?",
    "{name} has ${p}. {name} spends a quarter of it on lunch and ${a} on a book. How much money is left?",
]

NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lucas", "Priya", "Olga", "Diego", "Fatima", "Noah", "Mei", "Samuel"]

PUZZLES = [
    "If it takes {a} machines {a} minutes to make {a} widgets, how long would it take {p} machines to make {p} widgets?",
    "{name} is taller than {other}, and {other} is taller than Sam. Who is the shortest? Explain your reasoning.",
    "A bat and a ball cost ${c}.10 in total. The bat costs ${c} more than the ball. How much does the ball cost?",
    "There are {a} red socks and {b} blue socks in a drawer. How many socks must you take out in the dark to be sure of a matching pair?",
    "If today is {day}, what day of the week will it be in {p} days?",
]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

GERMAN = [
    "Der Zug nach Hamburg hat heute wegen eines Sturms zwei Stunden Verspätung.",
    "Die Stadtverwaltung plant, im nächsten Jahr drei neue Spielplätze zu bauen.",
    "Nach dem Spiel erklärte der Trainer, dass seine Mannschaft zu viele Fehler gemacht habe.",
    "Das Museum zeigt eine Ausstellung über die Geschichte der Seefahrt im Mittelalter.",
    "Wegen der anhaltenden Hitze wurden die Bürger gebeten, Wasser zu sparen.",
    "Die Forscher haben eine neue Käferart im Regenwald von Borneo entdeckt.",
    "Am Wochenende findet auf dem Marktplatz ein großes Musikfestival statt.",
    "Der Bürgermeister versprach, die Straßen der Altstadt bis zum Sommer zu reparieren.",
    "Die Preise für Strom und Gas sind in den letzten Monaten deutlich gestiegen.",
    "Im Finale setzte sich die junge Spielerin nach drei spannenden Sätzen durch.",
    "Die Polizei sucht nach Zeugen, die den Unfall auf der Autobahn beobachtet haben.",
    "Viele Studenten arbeiten neben dem Studium, um ihre Miete bezahlen zu können.",
    "Die neue Brücke soll den Verkehr in der Innenstadt spürbar entlasten.",
    "Der Verein feiert in diesem Jahr sein hundertjähriges Bestehen mit einem Fest.",
    "Die Bibliothek bleibt wegen Renovierungsarbeiten bis Ende März geschlossen.",
    "Ein Sprecher des Unternehmens bestätigte, dass zweihundert neue Stellen geschaffen werden.",
]

FRENCH = [
    "Le gouvernement a annoncé de nouvelles mesures pour soutenir les petites entreprises.",
    "Les enfants ont passé l'après-midi à construire un château de sable sur la plage.",
    "La récolte de cette année a été plus abondante que prévu grâce à la pluie.",
    "Le musée du village expose des outils anciens utilisés par les agriculteurs.",
    "Après une longue discussion, le conseil municipal a approuvé le projet.",
    "Le festival de cinéma attire chaque été des milliers de visiteurs.",
]

ENGLISH = [
    "The committee will publish its final report early next month.",
    "Heavy rain caused flooding in several villages along the river.",
    "She practised the violin every evening for ten years before her first concert.",
    "The new hospital wing will add two hundred beds and a modern emergency room.",
    "Scientists warn that the glacier is melting faster than expected.",
    "The bakery on the corner sells fresh bread every morning at six.",
    "Our team finished the project two weeks ahead of schedule.",
    "The old lighthouse has guided ships safely into the harbour for a century.",
]

PASSAGES = [
    "The town council met on Tuesday to discuss the future of the old railway station, which has been empty for eleven years. "
    "Several residents argued that the building should become a community centre with a library and a cafe, while a developer "
    "proposed turning it into apartments. The council agreed to commission a study of both options and will vote on the "
    "matter in the spring. The mayor said that whatever the outcome, the historic clock tower would be preserved.",
    "A small team of volunteers has restored a nineteenth-century sailing boat that was found half-buried in the mud of an "
    "estuary. The work took four years and used traditional techniques, including hand-sewn sails and wooden nails. The boat "
    "made its first voyage last weekend, watched by hundreds of people on the quay. The volunteers now plan to offer free "
    "trips to school groups so that children can learn about the region's maritime history.",
    "Researchers studying sleep found that teenagers who used their phones in the hour before bed fell asleep on average "
    "forty minutes later than those who did not. The study followed three thousand students for a year and also measured "
    "their grades and mood. Students with later bedtimes reported feeling more tired during lessons. The authors recommend "
    "that families agree on a time in the evening after which screens are switched off.",
    "The city's bicycle-sharing scheme celebrated its fifth anniversary with record numbers. More than two million trips were "
    "made last year, an increase of thirty percent, and the operator added five hundred electric bikes to the fleet. Critics "
    "say that the stations are concentrated in the centre and that outer districts are poorly served. The operator replied "
    "that forty new stations will open in the suburbs over the next two years.",
    "A local farmer has become an unlikely internet celebrity after posting videos of his goats climbing trees. The videos, "
    "which he began filming to amuse his grandchildren, have been viewed millions of times. Tourists now visit the farm every "
    "weekend, and the farmer has opened a small shop selling cheese made from the goats' milk. He says the attention has "
    "saved the farm, which was struggling financially only two years ago.",
    "The national weather service issued a warning for strong winds along the coast, with gusts expected to reach one hundred "
    "kilometres per hour on Thursday night. Ferry services have been cancelled, and residents are advised to secure garden "
    "furniture and avoid walking near cliffs. Forecasters expect the storm to weaken by Saturday morning, although heavy "
    "rain may continue inland until Sunday.",
    "The history of tea stretches back thousands of years to ancient China, where it was first used as a medicine. Over the "
    "centuries it spread along trade routes to Japan, India and eventually Europe, where it became fashionable in the "
    "seventeenth century. Today tea is the second most consumed drink in the world after water, and it is grown on large "
    "plantations in countries such as Kenya, Sri Lanka and India.",
    "Honey bees communicate the location of flowers through a movement called the waggle dance. A forager returning to the "
    "hive moves in a figure-eight pattern, and the angle of the straight part of the dance shows the direction of the food "
    "relative to the sun. The length of the waggle indicates the distance. Other bees follow the dancer and then fly out to "
    "find the flowers themselves.",
    "The Great Barrier Reef, off the coast of Queensland in Australia, is the largest coral reef system in the world. It is "
    "made up of almost three thousand individual reefs and hundreds of islands, and it can be seen from space. The reef is "
    "home to thousands of species of fish, molluscs and corals. Rising sea temperatures have caused several mass bleaching "
    "events in recent decades, and scientists are working on ways to help the corals recover.",
    "Mount Everest, on the border between Nepal and China, is the highest mountain above sea level at 8,849 metres. The "
    "first confirmed ascent was made in 1953 by Edmund Hillary and Tenzing Norgay. Today hundreds of climbers attempt the "
    "summit each year, mostly in May, when the weather is calmest. The climb is dangerous because of the thin air, the cold "
    "and the risk of avalanches.",
]

PASSAGE_TASKS = [
    "Summarize: {x}",
    "Summarize the following text in two sentences.\n\n{x}",
    "{x}\n\nWhat is the main point of this text?",
    "Read the text and list the key facts as bullet points.\n\n{x}",
    "{x}\n\nWrite three questions about this text and answer them.",
    "Extract every number mentioned in the following text and say what it refers to.\n\n{x}",
    "Write a headline for this news story: {x}",
]

EXTRA_CODE_TASKS = [
    "counts how often each word appears in a text file", "validates an email address", "flattens a nested list",
    "computes the greatest common divisor of two numbers", "finds all anagrams of a word in a list",
    "parses a date string and returns the day of the week", "implements binary search", "transposes a matrix",
    "generates all permutations of a string", "computes the median of a list of numbers",
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
        pool += [template.format(s=s) for s in SENTENCES + ENGLISH]
    pool += [f"Translate German to English: {s}" for s in GERMAN]
    pool += [f"Translate French to English: {s}" for s in FRENCH]
    pool += [f"Translate into German: {s}" for s in ENGLISH]
    for template in QUESTIONS:
        pool += [template.format(place=p) for p in PLACES]
    for template in FACTS:
        pool += [template.format(thing=t) for t in THINGS]
    pool += [f"Pretend you are {p}. {q}" for p in PERSONAS for q in PERSONA_ASKS]
    for i, template in enumerate(WORD_PROBLEMS + PUZZLES):
        for j in range(8):
            a, b = 3 + (7 * j + i) % 19, 2 + (5 * j + 3 * i) % 11
            pool.append(template.format(name=NAMES[(i + j) % len(NAMES)], other=NAMES[(i + j + 5) % len(NAMES)], a=a, b=b,
                                        c=b + 1, p=a * b + 10 * j + 20, day=DAYS[(i + j) % 7]))
    for template in PASSAGE_TASKS:
        pool += [template.format(x=x) for x in PASSAGES]
    for template in CODE:
        pool += [template.format(task=task) for task in EXTRA_CODE_TASKS]
    pool = sorted(set(pool))
    rng.shuffle(pool)
    return pool[:count]
