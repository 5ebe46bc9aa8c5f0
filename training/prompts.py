"""Training prompts written for this project: templates x fillers, 6954 distinct, deterministic,
plus second turns built on the model's own first answers (``follow_up_conversation``).

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
    "the ocean",
    "volcanoes",
    "honey bees",
    "the moon landing",
    "electric cars",
    "photosynthesis",
    "the Roman Empire",
    "chess",
    "climate change",
    "machine learning",
    "the human heart",
    "black holes",
    "coffee",
    "the printing press",
    "renewable energy",
    "origami",
    "the immune system",
    "ancient Egypt",
    "recycling",
    "jazz music",
    "mountain climbing",
    "the internet",
    "dinosaurs",
    "gardening",
    "the stock market",
    "rainforests",
    "vaccines",
    "the French Revolution",
    "bicycles",
    "solar panels",
    "penguins",
    "the Olympic Games",
    "baking bread",
    "quantum computers",
    "deserts",
    "public libraries",
    "earthquakes",
    "the Silk Road",
    "robots",
    "meditation",
    "coral reefs",
    "the theory of evolution",
    "smartphones",
    "the water cycle",
    "Shakespeare",
    "space telescopes",
    "trains",
    "friendship",
    "board games",
    "the Great Wall of China",
    "wolves",
    "nutrition",
    "3D printing",
    "hurricanes",
    "the piano",
    "cryptography",
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
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a sentence",
    "merges two sorted lists",
    "finds the largest element of a list",
    "computes the factorial of n",
    "removes duplicates from a list",
    "converts Celsius to Fahrenheit",
    "returns the n-th Fibonacci number",
    "checks whether a string is a palindrome",
    "sorts a list of dictionaries by a key",
    "reads a CSV file and sums a column",
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
    "Where is {place} located?",
    "What is {place} famous for?",
    "What language do people speak in {place}?",
    "What is the climate like in {place}?",
    "Name three things a visitor should see in {place}.",
]

PLACES = [
    "Patagonia",
    "the Sahara",
    "Kyoto",
    "Lake Baikal",
    "Iceland",
    "the Amazon basin",
    "Mount Kilimanjaro",
    "Tasmania",
    "the Alps",
    "Madagascar",
    "Istanbul",
    "the Atacama Desert",
    "Scotland",
    "Lake Titicaca",
    "the Himalayas",
    "Cape Town",
    "Vancouver",
    "the Galapagos Islands",
    "Prague",
    "Mongolia",
    "the Dead Sea",
    "New Zealand",
    "Bavaria",
    "Havana",
]

FACTS = [
    "Who invented {thing}?",
    "When was {thing} invented, and why did it matter?",
    "How does {thing} work?",
    "What problem did {thing} solve?",
]

THINGS = [
    "the telephone",
    "the steam engine",
    "the light bulb",
    "the compass",
    "paper",
    "the microscope",
    "the radio",
    "the airplane",
    "penicillin",
    "the transistor",
    "the World Wide Web",
    "the mechanical clock",
    "glass lenses",
    "the refrigerator",
    "the bicycle",
    "concrete",
    "the battery",
    "the camera",
    "the sewing machine",
    "the vaccine",
]

PERSONAS = [
    "a pirate captain",
    "a medieval knight",
    "a grumpy librarian",
    "an astronaut on the space station",
    "a famous chef",
    "a detective from the 1920s",
    "a wise old wizard",
    "a cheerful kindergarten teacher",
    "a marine biologist",
    "a time traveller from the year 3000",
    "a sports commentator",
    "a Shakespearean actor",
]

PERSONA_ASKS = [
    "What is your opinion on umbrellas?",
    "Describe your typical morning.",
    "Give me advice about saving money.",
    "What do you think of modern music?",
    "Tell me about the hardest day of your life.",
    "How should I prepare for a job interview?",
    "What is the most important lesson you have learned?",
    "Recommend a good book and explain why.",
]

WORD_PROBLEMS = [
    "{name} buys {a} boxes of apples. Each box holds {b} apples and costs ${c}. "
    "How many apples does {name} have, and how much did they cost?",
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
    "counts how often each word appears in a text file",
    "validates an email address",
    "flattens a nested list",
    "computes the greatest common divisor of two numbers",
    "finds all anagrams of a word in a list",
    "parses a date string and returns the day of the week",
    "implements binary search",
    "transposes a matrix",
    "generates all permutations of a string",
    "computes the median of a list of numbers",
]


# ----------------------------------------------------------------------------- the wider pool (issue: 5x data)

MORE_TOPICS = [
    "the metric system",
    "sharks",
    "public transport",
    "the Industrial Revolution",
    "video games",
    "comets",
    "the Byzantine Empire",
    "urban gardening",
    "bamboo",
    "fermentation",
    "elephants",
    "the Mayan civilization",
    "podcasts",
    "the periodic table",
    "classical music",
    "beekeeping",
    "the Arctic",
    "electric guitars",
    "migration of birds",
    "wildfires",
    "marathons",
    "mushrooms",
    "skyscrapers",
    "antibiotics",
    "the human brain",
    "satellites",
    "folk tales",
    "the printing of money",
    "volunteering",
    "camping",
    "rivers",
    "the Ottoman Empire",
    "owls",
    "wind energy",
    "spices",
    "the Great Barrier Reef",
    "social media",
    "pottery",
    "the Aztecs",
    "hiking boots",
    "fossils",
    "museums",
    "the speed of light",
    "tornadoes",
    "chocolate",
    "the telescope",
    "the Sahara caravans",
    "opera",
    "hedgehogs",
    "ice hockey",
    "canals",
    "paper money",
    "the Hanseatic League",
    "puppetry",
    "the Gobi desert",
    "kites",
    "sundials",
    "the Nile",
    "astronomy clubs",
    "tapestries",
    "yoga",
    "seahorses",
    "carpentry",
]

MORE_TEMPLATES = [
    "Write a limerick about {t}.",
    "Write a haiku sequence (three haikus) about {t}.",
    "Outline a five-minute presentation about {t}.",
    "Write a news report from the future about {t}.",
    "Explain {t} using an analogy from everyday life.",
    "What would happen if {t} disappeared tomorrow?",
    "Write a diary entry of someone who discovers {t} for the first time.",
    "Give me a one-week study plan to learn about {t}.",
    "Write a short speech for a school assembly about {t}.",
    "Describe {t} in exactly five sentences.",
    "Write a children's picture-book text about {t}.",
    "What are the ethical questions raised by {t}?",
    "Write ten trivia questions about {t}, with answers.",
    "Write a job advertisement for an expert in {t}.",
    "Explain why {t} matters to a sceptical friend.",
]

HOWTO = [
    "How do I {a}? Give step-by-step instructions.",
    "What are the most common mistakes people make when they {a}?",
    "Write a checklist for someone who wants to {a}.",
    "I want to {a} but I only have one hour. What should I do?",
]

ACTIVITIES = [
    "plant tomatoes",
    "change a bicycle tyre",
    "write a cover letter",
    "start running",
    "learn to juggle",
    "make pancakes",
    "organise a birthday party",
    "save money on groceries",
    "prepare for an exam",
    "clean a laptop keyboard",
    "paint a room",
    "write a short story",
    "learn to play the guitar",
    "set up a fish tank",
    "plan a road trip",
    "improve my handwriting",
    "make a budget",
    "bake a chocolate cake",
    "take better photos with a phone",
    "learn a new language",
    "fall asleep faster",
    "give a good presentation",
    "build a bookshelf",
    "start a vegetable garden",
    "train a puppy",
    "make a paper plane",
    "brew coffee at home",
    "write a poem",
    "negotiate a salary",
    "keep a journal",
    "sew a button",
    "make friends in a new city",
]

CLASSIFY = [
    "Is the following sentence positive, negative or neutral? Explain briefly: {s}",
    "Rewrite this sentence for a five-year-old: {s}",
    "Turn this sentence into a question: {s}",
    "Continue this text with three more sentences: {s}",
    "Write the opposite of this statement: {s}",
    "Paraphrase this sentence in three different ways: {s}",
]

MORE_SENTENCES = [
    "The new phone lasts two full days on a single charge.",
    "Nobody came to the meeting, so we cancelled it.",
    "The soup was cold and the waiter ignored us all evening.",
    "Our neighbours planted a row of cherry trees along the fence.",
    "The final exam was easier than anyone expected.",
    "He forgot his umbrella and got soaked on the way to work.",
    "The concert was postponed because the singer was ill.",
    "The town built a new swimming pool for the children.",
    "I finally finished reading the book you lent me.",
    "The train was crowded, but the journey was quick.",
    "After the storm, the streets were covered in leaves.",
    "The team celebrated their victory late into the night.",
]

CODE_LANGS = ["Python", "JavaScript", "Go", "Rust", "C", "Java", "TypeScript", "Bash"]
CODE_ASKS = [
    "Write a {lang} function that {task}.",
    "Write a {lang} program that {task}, and explain how it works.",
    "Show how to write a function in {lang} that {task}, with comments.",
]
MORE_CODE_TASKS = [
    "checks whether a year is a leap year",
    "converts a Roman numeral to an integer",
    "counts the vowels in a string",
    "returns the smallest positive number in a list",
    "checks whether two strings are anagrams",
    "computes the average of a list",
    "finds the longest word in a sentence",
    "capitalizes the first letter of every word",
    "rotates a list by k positions",
    "checks whether parentheses in a string are balanced",
    "converts a number to binary",
    "sums the digits of a number",
    "finds the intersection of two lists",
    "removes all vowels from a string",
    "generates the first n prime numbers",
    "counts the lines of a text file",
    "returns the most common element of a list",
    "splits a list into chunks of size n",
]

SNIPPETS = [
    "def add(a, b):\n    return a - b",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)",
    "numbers = [3, 1, 2]\nnumbers.sort()\nprint(numbers[0])",
    "def is_even(n):\n    return n % 2 == 1",
    "total = 0\nfor x in [1, 2, 3, 4]:\n    total += x\nprint(total / len([1, 2, 3, 4]))",
    "function greet(name) {\n  return 'Hello, ' + name;\n}\nconsole.log(greet('Ada'));",
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY COUNT(*) DESC;",
    "words = text.split()\ncounts = {}\nfor w in words:\n    counts[w] = counts.get(w, 0) + 1",
    "def reverse(s):\n    return s[::-1]\nprint(reverse('hello'))",
]
SNIPPET_ASKS = [
    "Explain what this code does, line by line:\n\n{code}",
    "Is there a bug in this code? If so, fix it:\n\n{code}",
    "Rewrite this code to be clearer and add comments:\n\n{code}",
    "What does this code print, and why?\n\n{code}",
]

LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese", "Dutch"]

MORE_PASSAGES = [
    "The city library introduced a scheme last year that lets residents borrow tools as well as books. Drills, ladders, "
    "sewing machines and even a pressure washer can be reserved online for up to a week. More than two thousand people have "
    "used the service so far, and the most popular item is a carpet cleaner. The library says the scheme saves money and "
    "reduces waste, and it plans to add gardening equipment in the summer.",
    "A study of ten thousand commuters found that people who cycled to work took fewer sick days than those who drove. "
    "Cyclists also reported better sleep and lower stress. The researchers note that cyclists may have been healthier to begin "
    "with, but the difference remained after accounting for age and income. The city plans to build forty kilometres of new "
    "cycle lanes over the next three years.",
    "The annual village fair was held on Saturday despite heavy rain in the morning. Organisers moved the cake competition "
    "into the church hall, where seventy entries were judged. The prize for the largest pumpkin went to a retired teacher for "
    "the third year in a row. In the afternoon the sun came out and around two thousand visitors enjoyed music, games and a "
    "parade of vintage tractors.",
    "Engineers have completed a bridge that opens like an eye to let boats pass. The structure took three years to build and "
    "cost twelve million euros. Its two curved arms rotate together in about four minutes, powered by small electric motors. "
    "The bridge replaces a ferry that carried pedestrians across the harbour for more than a century.",
    "A local bakery has started giving its unsold bread to a food bank every evening. The owner said that about thirty loaves "
    "were thrown away each day before the arrangement began. Volunteers collect the bread at closing time and deliver it to "
    "families the next morning. Three other shops in the street have since joined the scheme.",
    "Scientists tagged forty sea turtles off the coast to learn where they travel in winter. The trackers showed that some "
    "turtles swam more than two thousand kilometres to warmer waters, while others stayed close to shore. The team hopes "
    "the data will help protect feeding grounds. The tags fall off after about a year and do not harm the animals.",
]

MORE_PASSAGE_TASKS = [
    "{x}\n\nWho is affected by what this text describes, and how?",
    "Rewrite the following text as a short dialogue:\n\n{x}",
    "{x}\n\nWhat questions does this text leave unanswered?",
    "Translate the following text into French:\n\n{x}",
    "Give this text a title and a one-sentence summary.\n\n{x}",
    "{x}\n\nIs this good news or bad news? Explain.",
]

# second turns, asked after the model's own first answer (training_conversations)
FOLLOW_UPS = [
    "Can you make that shorter?",
    "Please explain that in simpler words.",
    "Can you give me an example?",
    "Now summarize your answer in one sentence.",
    "Can you turn that into a bulleted list?",
    "What is the most important point?",
    "Can you expand on the second point?",
    "Translate your answer into French.",
    "Rewrite it in a more formal style.",
    "Thanks! Can you add a conclusion?",
    "Why is that true?",
    "What would a critic say about your answer?",
    "Write three questions a student might ask about this.",
    "Can you make it funnier?",
    "Give me a title for that.",
]
# tasks over the model's own answer as a long input (training_conversations)
OWN_TEXT_TASKS = [
    "Summarize the following text in two sentences.\n\n{x}",
    "List the key points of this text as bullet points.\n\n{x}",
    "{x}\n\nWrite three quiz questions about the text above, with answers.",
    "Extract every name, place and number from this text.\n\n{x}",
    "Rewrite the following text for a child:\n\n{x}",
]


def wider_pool() -> list[str]:
    """The prompts added for training at scale: new templates, topics and task families."""
    pool: list[str] = []
    topics = TOPICS + MORE_TOPICS
    for i, template in enumerate(TEMPLATES + MORE_TEMPLATES):
        for j, topic in enumerate(topics):
            pool.append(template.format(t=topic, u=topics[(j + 7 + i) % len(topics)]))
    for template in HOWTO:
        pool += [template.format(a=a) for a in ACTIVITIES]
    for template in CLASSIFY:
        pool += [template.format(s=s) for s in SENTENCES + ENGLISH + MORE_SENTENCES]
    for template in CODE_ASKS:
        pool += [template.format(lang=lang, task=task) for lang in CODE_LANGS for task in CODE_TASKS + EXTRA_CODE_TASKS + MORE_CODE_TASKS]
    pool += [ask.format(code=code) for ask in SNIPPET_ASKS for code in SNIPPETS]
    for lang in LANGUAGES:
        pool += [f"Translate into {lang}: {s}" for s in SENTENCES + ENGLISH + MORE_SENTENCES]
    pool += [f"Translate into English: {s}" for s in GERMAN + FRENCH]
    for template in MATH:
        for a in (4, 7, 9, 15, 21, 33, 56, 64, 75, 99, 144, 250):
            pool.append(template.format(a=a, b=a % 9 + 3, c=a * 5 + 2))
    for i, template in enumerate(WORD_PROBLEMS + PUZZLES):
        for j in range(8, 24):
            a, b = 3 + (7 * j + i) % 23, 2 + (5 * j + 3 * i) % 13
            pool.append(
                template.format(
                    name=NAMES[(i + j) % len(NAMES)],
                    other=NAMES[(i + j + 5) % len(NAMES)],
                    a=a,
                    b=b,
                    c=b + 1,
                    p=a * b + 10 * j + 20,
                    day=DAYS[(i + j) % 7],
                )
            )
    for template in PASSAGE_TASKS + MORE_PASSAGE_TASKS:
        pool += [template.format(x=x) for x in PASSAGES + MORE_PASSAGES]
    pool += [f"Pretend you are {p}. {q}" for p in PERSONAS for q in PERSONA_ASKS + [f"Explain {t} to me." for t in MORE_TOPICS[:12]]]
    for template in QUESTIONS + ["What is the history of {place}?", "Plan a three-day trip to {place}."]:
        pool += [template.format(place=p) for p in PLACES]
    return pool


def follow_up_conversation(prompt: str, answer: str, index: int) -> list[dict]:
    """A second turn on the model's own answer: a follow-up question, or a task over the answer as
    a long input, chosen by ``index``; the messages end with the user's turn."""
    if index % 3 == 2:  # the answer as a document to work on
        return [{"role": "user", "content": OWN_TEXT_TASKS[(index // 3) % len(OWN_TEXT_TASKS)].format(x=answer.strip())}]
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": answer.strip()},
        {"role": "user", "content": FOLLOW_UPS[index % len(FOLLOW_UPS)]},
    ]


def training_prompts(count: int = 400, seed: int = 0) -> list[str]:
    """``count`` distinct prompts, the same for the same seed, and the first ``count`` of any larger
    ``count`` (a resumed run asked for more continues the same list); ``ValueError`` when the pool
    has fewer."""
    pool = builtin_pool()
    if count > len(pool):
        raise ValueError(f"the built-in pool has {len(pool)} distinct prompts, fewer than {count}")
    random.Random(seed).shuffle(pool)
    return pool[:count]


def builtin_pool() -> list[str]:
    """Every distinct built-in prompt, sorted (``training_prompts`` shuffles them by seed)."""
    return sorted(set(original_pool() + wider_pool()))


def original_pool() -> list[str]:
    """The prompts of the first training runs (a subset of the pool)."""
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
            pool.append(
                template.format(
                    name=NAMES[(i + j) % len(NAMES)],
                    other=NAMES[(i + j + 5) % len(NAMES)],
                    a=a,
                    b=b,
                    c=b + 1,
                    p=a * b + 10 * j + 20,
                    day=DAYS[(i + j) % 7],
                )
            )
    for template in PASSAGE_TASKS:
        pool += [template.format(x=x) for x in PASSAGES]
    for template in CODE:
        pool += [template.format(task=task) for task in EXTRA_CODE_TASKS]
    return pool


def pool_digest() -> str:
    """A short hash of the built-in pool: a work folder made from another pool is not resumed."""
    import hashlib

    return hashlib.sha256("\n".join(builtin_pool()).encode()).hexdigest()[:16]
