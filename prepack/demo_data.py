"""A small, deterministic BAGEL-format dataset of all three kinds, made from scikit-image's photos.

Why: the packer, the loader and the comparison with the reference need real-looking inputs of every
kind (t2i parquet, edit parquet with ``parquet_info.json``, LLaVA-style JSONL with images, videos and
frame folders) without downloading anything.  The same seed gives byte-identical files.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TypeVar

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

T2I_FILES = 4
T2I_ROWS_PER_GROUP = 5
EDIT_FILES = 4
EDIT_ROWS_PER_GROUP = 4
ROW_GROUPS = 2
VIDEO_FRAMES = 30
JPEG_QUALITY = 88


@dataclass(frozen=True)
class DemoData:
    """Absolute paths of everything :func:`write_demo_data` wrote."""

    root: str
    t2i_dir: str
    t2i_files: tuple[str, ...]
    edit_image_dir: str
    edit_files: tuple[str, ...]
    edit_parquet_info: str
    vlm_image_dir: str
    vlm_jsonl: str
    videos: tuple[str, ...]
    frame_dirs: tuple[str, ...]
    num_t2i_rows: int
    num_edit_rows: int
    num_vlm_rows: int
    files: tuple[str, ...]


@dataclass(frozen=True)
class _Photo:
    """One scikit-image photograph and the facts the generated text may state about it."""

    key: str
    noun: str
    short: tuple[str, ...]
    details: tuple[str, ...]
    qa: tuple[tuple[str, str], ...]
    grey: bool = False


_PHOTOS: tuple[_Photo, ...] = (
    _Photo(
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
    _Photo(
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
    _Photo(
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
    _Photo(
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
    _Photo(
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
    _Photo(
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
    _Photo(
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
    _Photo(
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
    _Photo(
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
    _Photo(
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
    _Photo(
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
    _Photo(
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

_LOGO = _Photo(
    "logo",
    "the scikit-image logo",
    ("The scikit-image logo: a green and orange oval with a snake.",
     "A logo with an S-shaped curve and a drawing of a snake."),
    ("The logo is an oval split into green and orange halves by a white S-shaped curve.",
     "A line drawing of a snake's head appears in the upper part.",
     "The corners around the oval are transparent."),
    (),
)

_GENERIC = (
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

_INTROS = (
    "This image shows {noun}.",
    "The picture is of {noun}.",
    "Here we see {noun}.",
    "The photograph shows {noun}.",
)
_OUTROS = (
    "Overall, it is a clear and well-composed picture of {noun}.",
    "Taken together, these details give a good sense of what it is like to look at {noun}.",
    "In short, the image is a simple but informative view of {noun}.",
)

_SHORT_QUESTIONS = (
    "What is shown in this image?",
    "Describe the image briefly.",
    "What is the main subject of this picture?",
    "Give a one-sentence caption for this photo.",
)
_LONG_QUESTIONS = (
    "Describe this image in detail.",
    "Write a detailed description of everything you can see.",
    "Give a thorough description of the picture, including the setting and the lighting.",
    "Can you explain what is going on in this image? Please be detailed.",
)
_COMPARE_QUESTIONS = (
    "Compare these two images.",
    "What are the differences between the first and the second picture?",
    "Describe both images and say how they differ.",
)

_TEXT_ONLY: tuple[tuple[str, tuple[str, ...]], ...] = (
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

_EDIT_OPS: dict[str, tuple[str, ...]] = {
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


def _scale_channels(image: Image.Image, factors: tuple[float, float, float]) -> Image.Image:
    channels = [band.point(lambda v, f=f: min(255, int(v * f + 0.5))) for band, f in zip(image.split(), factors)]
    return Image.merge("RGB", channels)


def _zoom(image: Image.Image, rng: np.random.RandomState) -> Image.Image:
    keep = rng.uniform(0.7, 0.85)
    w, h = image.size
    cw, ch = int(w * keep), int(h * keep)
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return image.crop((x0, y0, x0 + cw, y0 + ch)).resize((w, h), Image.Resampling.BICUBIC)


_EDIT_FUNCS: dict[str, Callable[[Image.Image, np.random.RandomState], Image.Image]] = {
    "mirror": lambda im, rng: ImageOps.mirror(im),
    "upside_down": lambda im, rng: ImageOps.flip(im),
    "rotate": lambda im, rng: im.transpose(Image.Transpose.ROTATE_270),
    "warm": lambda im, rng: _scale_channels(im, (1.15, 1.05, 0.8)),
    "cool": lambda im, rng: _scale_channels(im, (0.8, 0.95, 1.2)),
    "grey": lambda im, rng: ImageOps.grayscale(im).convert("RGB"),
    "zoom": _zoom,
    "blur": lambda im, rng: im.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(1.5, 3.5)))),
    "brighter": lambda im, rng: ImageEnhance.Brightness(im).enhance(float(rng.uniform(1.25, 1.5))),
    "darker": lambda im, rng: ImageEnhance.Brightness(im).enhance(float(rng.uniform(0.5, 0.7))),
    "contrast": lambda im, rng: ImageEnhance.Contrast(im).enhance(1.6),
    "vivid": lambda im, rng: ImageEnhance.Color(im).enhance(1.8),
    "invert": lambda im, rng: ImageOps.invert(im),
    "posterize": lambda im, rng: ImageOps.posterize(im, 3),
}


# --------------------------------------------------------------------------------------------------
# helpers


class _Photos:
    """Loads each scikit-image photo once per run, as a PIL image."""

    def __init__(self) -> None:
        self._cache: dict[str, Image.Image] = {}

    def get(self, photo: _Photo) -> Image.Image:
        if photo.key not in self._cache:
            from skimage import data

            array = getattr(data, photo.key)()
            if isinstance(array, tuple):  # stereo_motorcycle: (left, right, disparity)
                array = array[0]
            image = Image.fromarray(np.ascontiguousarray(array))
            if photo.grey:
                image = image.convert("L")
            elif image.mode not in ("RGB", "RGBA"):
                image = image.convert("RGB")
            self._cache[photo.key] = image
        return self._cache[photo.key]


def _random_view(
    rng: np.random.RandomState, image: Image.Image, lo: int = 200, hi: int = 900
) -> tuple[Image.Image, float]:
    """A random crop with a random aspect ratio, rescaled so each side lies in [lo, hi].

    Returns the view and the fraction of the photo's area it covers (used to word captions).
    """
    w, h = image.size
    aspect = float(np.exp(rng.uniform(np.log(0.55), np.log(1.9))))  # width / height
    area = rng.uniform(0.35, 1.0) * w * h
    cw = int(min(w, round(np.sqrt(area * aspect))))
    ch = int(min(h, round(cw / aspect)))
    cw = int(min(w, max(cw, round(ch * 0.55))))
    x0 = int(rng.randint(0, w - cw + 1))
    y0 = int(rng.randint(0, h - ch + 1))
    crop = image.crop((x0, y0, x0 + cw, y0 + ch))
    smin = lo / min(cw, ch)
    smax = hi / max(cw, ch)
    scale = float(rng.uniform(smin, smax)) if smin < smax else smax
    size = (max(lo, min(hi, round(cw * scale))), max(lo, min(hi, round(ch * scale))))
    return crop.resize(size, Image.Resampling.LANCZOS), (cw * ch) / (w * h)


def _encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    if fmt == "JPEG":
        image.save(buffer, format="JPEG", quality=JPEG_QUALITY, **options)
    else:
        image.save(buffer, format="PNG", **options)
    return buffer.getvalue()


def _pick(rng: np.random.RandomState, items: Sequence[_T], count: int | None = None) -> list[_T]:
    """``count`` distinct items in random order (all of them when ``count`` is None)."""
    order = rng.permutation(len(items))[: len(items) if count is None else count]
    return [items[int(i)] for i in order]


def _long_text(rng: np.random.RandomState, photo: _Photo, min_words: int, max_words: int) -> str:
    """A multi-sentence description of roughly ``min_words``..``max_words`` words."""
    target = int(rng.randint(min_words, max_words + 1))
    sentences = [_INTROS[rng.randint(len(_INTROS))].format(noun=photo.noun)]
    pool = _pick(rng, photo.details, len(photo.details)) + _pick(rng, _GENERIC, len(_GENERIC))
    outro = _OUTROS[rng.randint(len(_OUTROS))].format(noun=photo.noun)
    words = len(sentences[0].split()) + len(outro.split())
    for sentence in pool:
        if words >= target:
            break
        sentences.append(sentence)
        words += len(sentence.split())
    sentences.append(outro)
    return " ".join(sentences)


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def _captions(rng: np.random.RandomState, photo: _Photo, coverage: float, note: str = "") -> dict[str, str]:
    count = int(rng.randint(1, 4))
    framing = "A close-up crop of" if coverage < 0.55 else "A wide view of"
    options = [
        photo.short[rng.randint(len(photo.short))],
        f"{framing} {photo.noun}.",
        " ".join([_capitalised(photo.noun) + "."] + _pick(rng, photo.details, int(rng.randint(1, 4)))),
    ]
    chosen = _pick(rng, options, count)
    if note:
        chosen = [f"{text[:-1]}, {note}." for text in chosen]
    return {f"caption_{i}": text for i, text in enumerate(chosen)}


def _write_parquet(path: str, columns: dict[str, object], schema: object, rows_per_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pydict(columns, schema=schema)
    pq.write_table(table, path, row_group_size=rows_per_group, compression="zstd")


def _remove_stale_parquet(directory: str, keep: Sequence[str]) -> None:
    """The reference reads every ``*.parquet`` in a data dir, so leftovers would join the dataset."""
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".parquet") and path not in keep:
            logger.warning("removing stale %s", path)
            os.remove(path)


# --------------------------------------------------------------------------------------------------
# the three kinds


def _write_t2i(root: str, seed: int, photos: _Photos, written: list[str]) -> tuple[str, list[str], int]:
    import pyarrow as pa

    rng = np.random.RandomState([seed, 1])
    out = os.path.join(root, "t2i")
    os.makedirs(out, exist_ok=True)
    rows_per_file = T2I_ROWS_PER_GROUP * ROW_GROUPS
    total = T2I_FILES * rows_per_file
    order = [_PHOTOS[i % len(_PHOTOS)] for i in rng.permutation(total)]
    rgba_row, palette_row, png_rows = 3, 17, {11, 29}
    files = []
    schema = pa.schema([("image", pa.binary()), ("captions", pa.string())])
    for file_idx in range(T2I_FILES):
        images, captions = [], []
        for row in range(file_idx * rows_per_file, (file_idx + 1) * rows_per_file):
            photo = order[row]
            if row == rgba_row:
                photo = _LOGO
                view, coverage = _random_view(rng, photos.get(_LOGO).convert("RGBA"), hi=700)
                payload = _encode(view, "PNG")
                note = ""
            elif row == palette_row:
                view, coverage = _random_view(rng, photos.get(photo).convert("RGB"))
                palette = view.quantize(colors=48, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
                payload = _encode(palette, "PNG", transparency=0)
                note = "with a reduced colour palette"
            else:
                view, coverage = _random_view(rng, photos.get(photo))
                payload = _encode(view, "PNG" if row in png_rows else "JPEG")
                note = ""
            images.append(payload)
            captions.append(json.dumps(_captions(rng, photo, coverage, note)))
        path = os.path.join(out, f"part-{file_idx:05d}.parquet")
        _write_parquet(path, {"image": images, "captions": captions}, schema, T2I_ROWS_PER_GROUP)
        files.append(path)
        written.append(path)
    _remove_stale_parquet(out, files)
    logger.info("t2i: %d rows in %d files under %s", total, len(files), out)
    return out, files, total


def _write_edit(root: str, seed: int, photos: _Photos, written: list[str]) -> tuple[str, list[str], str, int]:
    import pyarrow as pa

    rng = np.random.RandomState([seed, 2])
    out = os.path.join(root, "edit", "images")
    os.makedirs(out, exist_ok=True)
    colour = [p for p in _PHOTOS if not p.grey]
    ops = sorted(_EDIT_OPS)
    rows_per_file = EDIT_ROWS_PER_GROUP * ROW_GROUPS
    schema = pa.schema(
        [("image_list", pa.list_(pa.binary())), ("instruction_list", pa.list_(pa.list_(pa.string())))]
    )
    files, info = [], {}
    for file_idx in range(EDIT_FILES):
        image_lists, instruction_lists = [], []
        for _ in range(rows_per_file):
            photo = colour[rng.randint(len(colour))]
            current, _ = _random_view(rng, photos.get(photo).convert("RGB"), lo=200, hi=640)
            chain = [_encode(current, "JPEG")]
            instructions = []
            for op in _pick(rng, ops, int(rng.randint(1, 4))):
                current = _EDIT_FUNCS[op](current, rng)
                chain.append(_encode(current, "JPEG"))
                instructions.append(_pick(rng, _EDIT_OPS[op], int(rng.randint(1, 4))))
            image_lists.append(chain)
            instruction_lists.append(instructions)
        path = os.path.abspath(os.path.join(out, f"edit-{file_idx:05d}.parquet"))
        _write_parquet(path, {"image_list": image_lists, "instruction_list": instruction_lists}, schema,
                       EDIT_ROWS_PER_GROUP)
        files.append(path)
        written.append(path)
        info[path] = {"num_row_groups": ROW_GROUPS}
    _remove_stale_parquet(out, files)
    info_path = os.path.join(root, "edit", "parquet_info.json")
    with open(info_path, "w") as handle:
        handle.write(json.dumps(info, indent=2, sort_keys=True) + "\n")
    written.append(info_path)
    total = EDIT_FILES * rows_per_file
    logger.info("edit: %d rows in %d files under %s", total, len(files), out)
    return out, files, info_path, total


def _yuv420_frame(rgb: np.ndarray) -> object:
    """A yuv420p frame (BT.601, limited range) converted here, with every byte of each plane set.

    Encoders read a little past the visible width; frames converted by PyAV leave that padding
    uninitialised, which made the output bytes vary from run to run.
    """
    import av

    height, width = rgb.shape[:2]
    r, g, b = (rgb[..., i].astype(np.float64) for i in range(3))
    y = 16.0 + (65.481 * r + 128.553 * g + 24.966 * b) / 255.0
    cb = 128.0 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255.0
    cr = 128.0 + (112.0 * r - 93.786 * g - 18.214 * b) / 255.0

    def subsample(plane: np.ndarray) -> np.ndarray:
        return plane.reshape(height // 2, 2, width // 2, 2).mean(axis=(1, 3))

    frame = av.VideoFrame(width, height, "yuv420p")
    for plane, values in zip(frame.planes, (y, subsample(cb), subsample(cr))):
        padded = np.zeros((plane.height, plane.line_size), np.uint8)
        padded[: values.shape[0], : values.shape[1]] = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        plane.update(padded.tobytes())
    return frame


def _write_video(path: str, frames: Sequence[np.ndarray], fps: int) -> None:
    """An MPEG-4 part 2 mp4 that decord reads, byte-identical on rerun.

    Not H.264: libx264 reads past the visible frame, and its bytes changed between identical
    single-threaded runs.  Frames are converted here so no uninitialised byte reaches the encoder.
    """
    import av

    height, width = frames[0].shape[:2]
    if height % 16 or width % 16:
        raise ValueError(f"video size must be a multiple of 16, got {width}x{height}")
    with av.open(path, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps, 1))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.thread_count = 1
        stream.bit_rate = 600_000
        for frame in frames:
            for packet in stream.encode(_yuv420_frame(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _pan_frames(
    rng: np.random.RandomState, image: Image.Image, size: tuple[int, int], count: int
) -> tuple[list[np.ndarray], str]:
    """Frames of a camera panning across ``image``; returns them and the direction in words."""
    width, height = size
    base = image.convert("RGB")
    zoom = rng.uniform(1.6, 2.2)
    scale = zoom * max(width / base.width, height / base.height)
    big = np.asarray(base.resize((round(base.width * scale), round(base.height * scale)), Image.Resampling.BICUBIC))
    span_x, span_y = big.shape[1] - width, big.shape[0] - height
    horizontal = span_x >= span_y
    forward = bool(rng.randint(2))
    frames = []
    for i in range(count):
        t = i / (count - 1)
        t = t if forward else 1.0 - t
        x = round(t * span_x) if horizontal else span_x // 2
        y = round(t * span_y) if not horizontal else span_y // 2
        frames.append(np.ascontiguousarray(big[y : y + height, x : x + width]))
    if horizontal:
        direction = "from left to right" if forward else "from right to left"
    else:
        direction = "from top to bottom" if forward else "from bottom to top"
    return frames, direction


def _human(text: str) -> dict[str, str]:
    return {"from": "human", "value": text}


def _gpt(text: str) -> dict[str, str]:
    return {"from": "gpt", "value": text}


def _write_vlm(root: str, seed: int, photos: _Photos, written: list[str]) -> tuple[str, str, list[str], list[str], int]:
    rng = np.random.RandomState([seed, 3])
    image_dir = os.path.join(root, "vlm", "images")
    os.makedirs(image_dir, exist_ok=True)
    counter = [0]

    def save_image(photo: _Photo) -> str:
        index = counter[0]
        counter[0] += 1
        view, _ = _random_view(rng, photos.get(photo))
        ext = "png" if index % 5 == 4 else "jpg"
        name = f"img_{index:03d}.{ext}"
        with open(os.path.join(image_dir, name), "wb") as handle:
            handle.write(_encode(view, "PNG" if ext == "png" else "JPEG"))
        written.append(os.path.join(image_dir, name))
        return name

    def any_photo() -> _Photo:
        return _PHOTOS[rng.randint(len(_PHOTOS))]

    rows: list[dict[str, object]] = []
    for i in range(20):  # single image: short and long answers
        photo = any_photo()
        name = save_image(photo)
        if i % 3 == 0:
            question = _SHORT_QUESTIONS[rng.randint(len(_SHORT_QUESTIONS))]
            answer = photo.short[rng.randint(len(photo.short))]
        elif i % 3 == 1:
            question, answer = photo.qa[rng.randint(len(photo.qa))]
        else:
            question = _LONG_QUESTIONS[rng.randint(len(_LONG_QUESTIONS))]
            answer = _long_text(rng, photo, 90, 220)
        prompt = f"<image>\n{question}" if rng.randint(4) else f"{question}\n<image>"
        rows.append({"image": name, "conversations": [_human(prompt), _gpt(answer)]})

    for _ in range(6):  # two images
        a, b = (_PHOTOS[int(k)] for k in rng.permutation(len(_PHOTOS))[:2])
        names = [save_image(a), save_image(b)]
        question = _COMPARE_QUESTIONS[rng.randint(len(_COMPARE_QUESTIONS))]
        answer = " ".join(
            [f"The first image shows {a.noun}, while the second shows {b.noun}.", a.details[0]]
            + _pick(rng, a.details[1:], int(rng.randint(1, 3)))
            + ["The second picture is quite different.", b.details[0]]
            + _pick(rng, b.details[1:], int(rng.randint(1, 3)))
            + ["Apart from both being pictures, they have little in common."]
        )
        layout = rng.randint(2)
        prompt = (f"Image 1: <image>\nImage 2: <image>\n{question}" if layout
                  else f"<image>\n<image>\n{question}")
        rows.append({"image": names, "conversations": [_human(prompt), _gpt(answer)]})

    for _ in range(5):  # multi-turn about one image
        photo = any_photo()
        name = save_image(photo)
        turns = [_human("<image>\n" + _SHORT_QUESTIONS[rng.randint(len(_SHORT_QUESTIONS))]),
                 _gpt(photo.short[rng.randint(len(photo.short))])]
        for question, answer in _pick(rng, photo.qa):
            turns += [_human(question), _gpt(answer)]
        turns += [_human(_LONG_QUESTIONS[rng.randint(len(_LONG_QUESTIONS))]), _gpt(_long_text(rng, photo, 120, 230))]
        rows.append({"image": name, "conversations": turns})

    for question, sentences in _pick(rng, _TEXT_ONLY, 4):  # text only
        rows.append({"conversations": [_human(question), _gpt(" ".join(sentences))]})

    videos, frame_dirs = [], []
    video_dir = os.path.join(image_dir, "videos")
    os.makedirs(video_dir, exist_ok=True)
    for index, size in enumerate([(160, 96), (128, 128), (144, 112)]):
        photo = any_photo()
        frames, direction = _pan_frames(rng, photos.get(photo), size, VIDEO_FRAMES)
        path = os.path.join(video_dir, f"clip_{index}.mp4")
        _write_video(path, frames, fps=10)
        videos.append(path)
        written.append(path)
        rows.append({"video": f"videos/clip_{index}.mp4", "conversations": _video_turns(rng, photo, direction)})

    for label, size, count in (("a", (160, 120), 16), ("b", (120, 160), 12)):
        photo = any_photo()
        frames, direction = _pan_frames(rng, photos.get(photo), size, count)
        folder = os.path.join(image_dir, "frames", f"clip_{label}")
        os.makedirs(folder, exist_ok=True)
        for i, frame in enumerate(frames, start=1):
            path = os.path.join(folder, f"frame_{i:05d}.jpg")
            with open(path, "wb") as handle:
                handle.write(_encode(Image.fromarray(frame), "JPEG"))
            written.append(path)
        frame_dirs.append(folder)
        rows.append({"video": f"frames/clip_{label}/", "conversations": _video_turns(rng, photo, direction)})

    order = rng.permutation(len(rows))
    jsonl = os.path.join(root, "vlm", "train.jsonl")
    with open(jsonl, "w") as handle:
        for i, position in enumerate(order):
            row = {"id": f"demo-{i:03d}", **rows[int(position)]}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    written.append(jsonl)
    logger.info("vlm: %d rows, %d images, %d videos, %d frame folders under %s",
                len(rows), counter[0], len(videos), len(frame_dirs), image_dir)
    return image_dir, jsonl, videos, frame_dirs, len(rows)


def _video_turns(rng: np.random.RandomState, photo: _Photo, direction: str) -> list[dict[str, str]]:
    """The ``<video>`` placeholder must be in the first human turn: the reference only looks there."""
    question = ("Describe what happens in this clip.", "What does the camera do in this video?",
                "Summarise the video.")[rng.randint(3)]
    answer = (f"The camera pans slowly {direction} across {photo.noun}. "
              + " ".join(_pick(rng, photo.details, 2))
              + " Nothing in the scene moves; only the viewpoint changes.")
    turns = [_human(f"<video>\n{question}"), _gpt(answer)]
    if rng.randint(2):
        turns += [_human("Which way does the camera move?"), _gpt(f"It moves {direction}.")]
    return turns


def write_demo_data(out_dir: str | os.PathLike[str], *, seed: int = 0) -> DemoData:
    """Write the demo dataset under ``out_dir``; the same seed rewrites the same bytes.

    Paths stored in data files are absolute (``os.path.abspath``) where the reference needs them:
    the keys of ``edit/parquet_info.json`` must equal ``os.path.join(data_dir, name)``.
    """
    root = os.path.abspath(os.fspath(out_dir))
    os.makedirs(root, exist_ok=True)
    logger.info("writing demo data (seed %d) to %s", seed, root)
    photos = _Photos()
    written: list[str] = []
    t2i_dir, t2i_files, t2i_rows = _write_t2i(root, seed, photos, written)
    edit_dir, edit_files, info_path, edit_rows = _write_edit(root, seed, photos, written)
    vlm_dir, jsonl, videos, frame_dirs, vlm_rows = _write_vlm(root, seed, photos, written)
    return DemoData(
        root=root,
        t2i_dir=t2i_dir,
        t2i_files=tuple(t2i_files),
        edit_image_dir=edit_dir,
        edit_files=tuple(edit_files),
        edit_parquet_info=info_path,
        vlm_image_dir=vlm_dir,
        vlm_jsonl=jsonl,
        videos=tuple(videos),
        frame_dirs=tuple(frame_dirs),
        num_t2i_rows=t2i_rows,
        num_edit_rows=edit_rows,
        num_vlm_rows=vlm_rows,
        files=tuple(sorted(written)),
    )
