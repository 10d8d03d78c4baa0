"""The demo dataset: real photographs (scikit-image), captions, edit chains, VLM dialogues, videos."""
