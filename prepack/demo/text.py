"""Demo dataset text: the scikit-image photographs, what may be said about each, and the
captions, questions, answers and edit instructions generated from those facts (deterministic)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

_T = TypeVar("_T")


@dataclass(frozen=True)
class Photo:
    """One scikit-image photograph and the facts the generated text may state about it."""

    key: str
    noun: str
    short: tuple[str, ...]
    details: tuple[str, ...]
    qa: tuple[tuple[str, str], ...]
    grey: bool = False


PHOTOS: tuple[Photo, ...] = (
    Photo(
        "astronaut",
        "an astronaut in an orange launch suit",
        ("An astronaut in an orange suit smiling for an official portrait.",
         "A smiling astronaut posing next to an American flag and a model space shuttle.",
         "Portrait of a woman in an orange pressure suit."),
        ("She is smiling at the camera and has short, light brown hair.",
         "Her orange pressure suit carries a round mission patch on the chest and a name tag.",
         "A white helmet with a dark visor rests in the lower right corner of the frame.",
         "On the left, part of an American flag with white stars on a blue field is visible.",
         "A model of the space shuttle, with its external tank and two boosters, stands in the background.",
         "The lighting is soft and even, as is typical of an official portrait."),
        (("What is the person wearing?", "She is wearing an orange launch and entry suit with a mission patch."),
         ("What object is on the right side of the picture?",
          "A white space helmet with a dark visor rests on the right, and a model shuttle stands behind it.")),
    ),
    Photo(
        "coffee",
        "a cup of espresso on a red saucer",
        ("A red cup of espresso on a saucer with a small spoon.",
         "Espresso with golden crema served on a wooden table.",
         "Top-down view of a coffee cup on a worn wooden table."),
        ("The cup is glossy red on the outside and white on the inside.",
         "A layer of golden-brown crema covers the surface of the coffee.",
         "A small metal spoon rests on the saucer beside the handle.",
         "The wooden table has visible grain and scratches, so it has clearly seen a lot of use.",
         "The photo is taken from above at an angle, which makes the round saucer look oval.",
         "Warm, dim light gives the scene the feeling of a quiet café."),
        (("What drink is in the cup?", "It is a shot of espresso with a thick layer of crema on top."),
         ("What colour is the cup?", "The cup and its saucer are a deep, glossy red.")),
    ),
    Photo(
        "rocket",
        "a rocket standing on its launch pad at dusk",
        ("A rocket on the launch pad under a deep blue evening sky.",
         "Floodlights shine around a launch pad with a tall white rocket.",
         "A rocket surrounded by lightning towers before launch."),
        ("The tall white rocket stands upright in the middle of the frame.",
         "Several lattice towers surround it; they are lightning masts that protect the vehicle.",
         "Bright floodlights near the ground form star-shaped flares.",
         "The sky fades from deep blue at the top to a faint glow near the horizon.",
         "The pad is far from the camera, so the rocket looks slender against the sky.",
         "It is probably the evening before a launch, with the vehicle lit up and ready."),
        (("What are the tall towers around the rocket?",
          "They are lightning protection towers that keep strikes away from the vehicle on the pad."),
         ("What time of day is it?", "It is dusk: the sky is still blue but the floodlights are already on.")),
    ),
    Photo(
        "chelsea",
        "a tabby cat",
        ("A close-up of a tabby cat with green eyes.",
         "An orange and brown striped cat looking to the side.",
         "Portrait of a cat with long white whiskers."),
        ("The cat has orange and brown stripes with lighter fur around its muzzle.",
         "Its large green-yellow eyes are looking slightly to one side.",
         "Long white whiskers stand out against the darker fur of its face.",
         "The background is out of focus, which keeps attention on the cat.",
         "Its nose is pink and its ears are upright and alert.",
         "The fur looks soft, clean and well groomed."),
        (("What animal is this?", "It is a domestic cat with a striped tabby coat."),
         ("What colour are the cat's eyes?", "Its eyes are a green-yellow colour with dark pupils.")),
    ),
    Photo(
        "camera",
        "a photographer with a camera on a tripod",
        ("A black and white photo of a man using a camera on a tripod.",
         "A photographer in a dark coat looking through his camera in a field.",
         "A man with a tripod camera standing on a lawn."),
        ("The photo is in black and white.",
         "The man wears a long dark coat and is looking through the viewfinder.",
         "The camera is mounted on a tall tripod in front of him.",
         "Short grass covers the ground, and a few buildings appear far behind him.",
         "The sky is pale and almost featureless.",
         "The camera looks like an older film model rather than a modern digital one."),
        (("What is the man doing?", "He is taking a photograph with a camera mounted on a tripod."),
         ("Is the photo in colour?", "No, it is a greyscale photograph.")),
        grey=True,
    ),
    Photo(
        "hubble_deep_field",
        "a deep-field image of distant galaxies",
        ("Hundreds of galaxies scattered across a black sky.",
         "A deep-field telescope image full of colourful galaxies.",
         "Distant spiral and elliptical galaxies against the darkness of space."),
        ("Dozens of galaxies of different shapes and colours are scattered over a black background.",
         "Some are spirals seen face-on, while others are elongated or irregular smudges.",
         "A few brighter objects are nearby stars rather than galaxies.",
         "Many of the faint red dots are galaxies billions of light years away.",
         "Almost every point of light in the picture is a whole galaxy.",
         "Images like this are made by pointing a space telescope at an empty-looking patch of sky for many hours."),
        (("What are the small coloured spots?",
          "Nearly all of them are distant galaxies, each containing billions of stars."),
         ("Where was this picture taken?", "It was taken by a space telescope looking into deep space.")),
    ),
    Photo(
        "immunohistochemistry",
        "a microscope image of stained tissue",
        ("A microscope slide of tissue with brown and blue staining.",
         "Immunohistochemistry staining of glandular tissue.",
         "Brown-stained cell membranes in a tissue sample under a microscope."),
        ("Brown staining marks the cell membranes in the rounded glandular structures.",
         "The surrounding tissue is stained light blue, with darker blue nuclei.",
         "The stained regions form folded shapes that look like glands.",
         "This kind of stain uses antibodies to highlight one particular protein.",
         "The brown colour comes from a chromogen deposited where the antibody binds.",
         "A pathologist would use the pattern to judge where the protein is expressed."),
        (("What kind of image is this?",
          "It is a light-microscope image of a tissue section stained by immunohistochemistry."),
         ("What does the brown colour show?", "It marks the places where the antibody found its target protein.")),
    ),
    Photo(
        "coins",
        "a collection of old coins laid out in rows",
        ("Rows of old coins photographed in black and white.",
         "A greyscale photo of two dozen ancient coins.",
         "Historical coins arranged in a neat grid."),
        ("Twenty-four coins are laid out in four rows of six on a dark background.",
         "The image is in greyscale, so the metals cannot be told apart by colour.",
         "Each coin shows a worn portrait or emblem.",
         "Some coins are noticeably larger than others.",
         "Light comes from one side, so the raised designs cast small shadows.",
         "They look like historical coins from a museum collection."),
        (("How many coins are there?", "There are twenty-four coins, arranged in four rows of six."),
         ("What is on the coins?", "Most of them show a worn portrait or an emblem in relief.")),
        grey=True,
    ),
    Photo(
        "stereo_motorcycle",
        "a red motorcycle parked in a garage",
        ("A red motorcycle parked inside a cluttered garage.",
         "A motorcycle with a red tank standing in a workshop.",
         "A classic red motorbike in front of shelves full of boxes."),
        ("The motorcycle has a red fuel tank and fenders and a black seat.",
         "Chrome exhaust pipes run along the lower side of the engine.",
         "Metal shelves full of cardboard boxes line the wall behind it.",
         "A wooden bench stands on the left side of the garage.",
         "The concrete floor has a few stains and scuff marks.",
         "The bike rests on its side stand and leans slightly."),
        (("Where is the motorcycle?", "It is parked inside a garage, in front of shelves with boxes."),
         ("What colour is the motorcycle?", "Its tank and fenders are red, with a black seat and a silver engine.")),
    ),
    Photo(
        "retina",
        "a photograph of the back of a human eye",
        ("A fundus photograph of a human retina.",
         "The back of the eye with blood vessels spreading from the optic disc.",
         "A medical image of the retina in orange and red tones."),
        ("The optic disc appears as a bright yellowish circle on one side.",
         "Blood vessels branch out from the disc across the orange-red retina.",
         "The darker area near the middle is the macula, which gives sharp central vision.",
         "The image is circular with a black border, as is typical of fundus cameras.",
         "Doctors use such images to check for diabetic retinopathy and glaucoma.",
         "The vessels become thinner as they spread towards the edges."),
        (("What does this image show?", "It shows the retina at the back of the eye, photographed through the pupil."),
         ("What is the bright spot?", "The bright spot is the optic disc, where the optic nerve leaves the eye.")),
    ),
    Photo(
        "moon",
        "the cratered surface of the Moon",
        ("A greyscale view of the lunar surface.",
         "Small craters and dark patches on the Moon.",
         "A low-contrast photo of moon terrain."),
        ("Craters of different sizes are scattered across a grey surface.",
         "A few dark patches break up the otherwise even grey.",
         "The contrast is low, so many details are subtle.",
         "One small, sharp crater near the top catches the light.",
         "There is no sky in the frame; the whole picture is ground.",
         "The image is in greyscale, as most lunar survey images are."),
        (("What is shown here?", "This is a close view of the Moon's surface with several craters."),
         ("Is there any sky visible?", "No, the whole frame is filled by the lunar surface.")),
        grey=True,
    ),
    Photo(
        "colorwheel",
        "a colour wheel",
        ("A colour wheel on a black background.",
         "A circle of hues fading to white in the centre.",
         "A rainbow colour wheel showing hue and saturation."),
        ("Hues run around the circle from red through yellow, green, cyan and blue to magenta.",
         "The colours become paler towards the centre, where they fade to white.",
         "The wheel sits on a plain black background.",
         "Such wheels are used to pick colours and to explain hue and saturation.",
         "Opposite sides of the wheel hold complementary colours.",
         "The transitions between hues are smooth, with no visible bands."),
        (("What is this?", "It is a colour wheel that maps hue around the circle and saturation along the radius."),
         ("What colour is in the centre?", "The centre is white, because saturation drops to zero there.")),
    ),
)


LOGO = Photo(
    "logo",
    "the scikit-image logo",
    ("The scikit-image logo: a green and orange oval with a snake.",
     "A logo with an S-shaped curve and a drawing of a snake."),
    ("The logo is an oval split into green and orange halves by a white S-shaped curve.",
     "A line drawing of a snake's head appears in the upper part.",
     "The corners around the oval are transparent."),
    (),
)


GENERIC = (
    "The framing puts the main subject near the centre, so it is clearly the focus of the picture.",
    "Fine details such as texture and small highlights become visible when you look closely.",
    "The edges of the frame are fairly tight, so only part of the surroundings can be seen.",
    "Nothing in the scene looks staged for effect; it reads as a straightforward record of the subject.",
    "The exposure is balanced, with no large areas that are completely black or blown out.",
    "The image is sharp enough to make out small details.",
    "The overall mood of the picture is calm and quiet.",
    "A viewer's eye is drawn first to the brightest part of the image and then to the rest of the scene.",
    "The composition is simple, which makes the picture easy to read at a glance.",
    "It would work well as an example photo in a textbook or a presentation.",
)


INTROS = (
    "This image shows {noun}.",
    "The picture is of {noun}.",
    "Here we see {noun}.",
    "The photograph shows {noun}.",
)


OUTROS = (
    "Overall, it is a clear and well-composed picture of {noun}.",
    "Taken together, these details give a good sense of what it is like to look at {noun}.",
    "In short, the image is a simple but informative view of {noun}.",
)


SHORT_QUESTIONS = (
    "What is shown in this image?",
    "Describe the image briefly.",
    "What is the main subject of this picture?",
    "Give a one-sentence caption for this photo.",
)


LONG_QUESTIONS = (
    "Describe this image in detail.",
    "Write a detailed description of everything you can see.",
    "Give a thorough description of the picture, including the setting and the lighting.",
    "Can you explain what is going on in this image? Please be detailed.",
)


COMPARE_QUESTIONS = (
    "Compare these two images.",
    "What are the differences between the first and the second picture?",
    "Describe both images and say how they differ.",
)


TEXT_ONLY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("How does a camera lens focus light?",
     ("A camera lens is made of curved pieces of glass that bend light as it passes through them.",
      "Light rays coming from a single point on the subject spread out, and the lens bends them back together.",
      "The place where they meet is the focal plane, where the sensor or film sits.",
      "To focus on something nearer, the lens moves slightly further from the sensor.",
      "Objects at other distances form their sharp image in front of or behind the sensor, so they look blurred.",
      "The aperture controls how wide the cone of light is; a smaller aperture gives a deeper zone of sharpness.",
      "That is why landscape photographers often use small apertures, while portrait photographers use wide ones.")),
    ("Why is the sky blue?",
     ("Sunlight contains all the colours of the visible spectrum.",
      "When it enters the atmosphere, it is scattered by the molecules of nitrogen and oxygen in the air.",
      "This kind of scattering is much stronger for short wavelengths, so blue light is scattered far more than red.",
      "Blue light therefore reaches our eyes from every direction in the sky.",
      "Violet is scattered even more, but our eyes are less sensitive to it and some of it is absorbed high up.",
      "At sunrise and sunset the light travels through much more air, so most of the blue is scattered away.",
      "What remains is the orange and red light that colours the evening sky.")),
    ("What is the difference between a star and a galaxy?",
     ("A star is a single ball of hot gas that produces energy by nuclear fusion in its core.",
      "Our Sun is a fairly ordinary star.",
      "A galaxy is an enormous system of stars, gas, dust and dark matter held together by gravity.",
      "The Milky Way, our own galaxy, contains hundreds of billions of stars.",
      "Galaxies come in several shapes, including spirals, ellipticals and irregular clouds.",
      "Most of the points of light you can see with the naked eye are stars in our own galaxy.",
      "Deep telescope images, by contrast, show thousands of other galaxies far beyond it.")),
    ("Give me three tips for keeping a cat happy indoors.",
     ("First, give the cat places to climb and to watch from, such as shelves or a tall cat tree near a window.",
      "Second, play with it every day using toys that move like prey, which keeps it active and curious.",
      "Third, keep its routine predictable: regular meals, a clean litter box and a quiet place to sleep.",
      "Cats also enjoy scratching posts, which protect your furniture at the same time.",
      "Finally, remember that every cat is different, so watch what yours enjoys and do more of it.")),
    ("Summarise what an espresso is in a few sentences.",
     ("Espresso is a small, concentrated coffee made by forcing hot water through finely ground coffee under pressure.",
      "A shot is usually about thirty millilitres and takes around twenty-five seconds to pull.",
      "The pressure extracts oils and fine particles that give espresso its body.",
      "A good shot is topped with crema, a golden foam of tiny bubbles.",
      "Espresso is also the base of many other drinks, such as cappuccino and latte.")),
)


EDIT_OPS: dict[str, tuple[str, ...]] = {
    "mirror": ("Flip the image horizontally.", "Mirror the picture from left to right.",
               "Make a mirror image of the scene.", "Reverse the image left to right."),
    "upside_down": ("Turn the picture upside down.", "Flip the image vertically.",
                    "Make the top of the image the bottom."),
    "rotate": ("Rotate the image ninety degrees clockwise.", "Turn the picture a quarter turn to the right.",
               "Rotate it by 90 degrees clockwise."),
    "warm": ("Make the colours warmer.", "Give the photo a warm, orange tint.",
             "Shift the colour balance towards red and yellow."),
    "cool": ("Give the image a cool blue tone.", "Make the colours colder.",
             "Shift the colour balance towards blue."),
    "grey": ("Convert the photo to black and white.", "Remove all the colour from the picture.",
             "Make it greyscale."),
    "zoom": ("Zoom in on the centre of the picture.", "Crop in closer to the middle.",
             "Trim the edges and enlarge the central part."),
    "blur": ("Blur the whole picture slightly.", "Make the image soft and out of focus.",
             "Apply a gentle blur."),
    "brighter": ("Make the image brighter.", "Increase the brightness.", "Lighten the whole photo."),
    "darker": ("Make the picture darker.", "Lower the brightness.", "Darken the image as if it were evening."),
    "contrast": ("Increase the contrast.", "Make the darks darker and the lights lighter.",
                 "Boost the contrast of the photo."),
    "vivid": ("Make the colours more vivid.", "Increase the saturation.", "Make the colours pop."),
    "invert": ("Invert the colours.", "Turn the image into a negative.", "Swap every colour for its opposite."),
    "posterize": ("Posterize the image.", "Reduce the number of colour levels so it looks like a poster.",
                  "Give it a flat, poster-like look with fewer shades."),
}


def pick(rng: np.random.RandomState, items: Sequence[_T], count: int | None = None) -> list[_T]:
    """``count`` distinct items in random order (all of them when ``count`` is None)."""
    order = rng.permutation(len(items))[: len(items) if count is None else count]
    return [items[int(i)] for i in order]


def long_text(rng: np.random.RandomState, photo: Photo, min_words: int, max_words: int) -> str:
    """A multi-sentence description of roughly ``min_words``..``max_words`` words."""
    target = int(rng.randint(min_words, max_words + 1))
    sentences = [INTROS[rng.randint(len(INTROS))].format(noun=photo.noun)]
    pool = pick(rng, photo.details, len(photo.details)) + pick(rng, GENERIC, len(GENERIC))
    outro = OUTROS[rng.randint(len(OUTROS))].format(noun=photo.noun)
    words = len(sentences[0].split()) + len(outro.split())
    for sentence in pool:
        if words >= target:
            break
        sentences.append(sentence)
        words += len(sentence.split())
    sentences.append(outro)
    return " ".join(sentences)


def capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def make_captions(rng: np.random.RandomState, photo: Photo, coverage: float, note: str = "") -> dict[str, str]:
    count = int(rng.randint(1, 4))
    framing = "A close-up crop of" if coverage < 0.55 else "A wide view of"
    options = [
        photo.short[rng.randint(len(photo.short))],
        f"{framing} {photo.noun}.",
        " ".join([capitalised(photo.noun) + "."] + pick(rng, photo.details, int(rng.randint(1, 4)))),
    ]
    chosen = pick(rng, options, count)
    if note:
        chosen = [f"{text[:-1]}, {note}." for text in chosen]
    return {f"caption_{i}": text for i, text in enumerate(chosen)}


def human(text: str) -> dict[str, str]:
    return {"from": "human", "value": text}


def gpt(text: str) -> dict[str, str]:
    return {"from": "gpt", "value": text}


def video_turns(rng: np.random.RandomState, photo: Photo, direction: str) -> list[dict[str, str]]:
    """The ``<video>`` placeholder must be in the first human turn: the reference only looks there."""
    question = ("Describe what happens in this clip.", "What does the camera do in this video?",
                "Summarise the video.")[rng.randint(3)]
    answer = (f"The camera pans slowly {direction} across {photo.noun}. "
              + " ".join(pick(rng, photo.details, 2))
              + " Nothing in the scene moves; only the viewpoint changes.")
    turns = [human(f"<video>\n{question}"), gpt(answer)]
    if rng.randint(2):
        turns += [human("Which way does the camera move?"), gpt(f"It moves {direction}.")]
    return turns

