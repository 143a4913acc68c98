"""The model files a workflow needs: which, where ComfyUI finds them, where they come from (`h3kit models`).

sources.py says where a file comes from: a loader node's `properties.models` entry in the workflow
(`name`, `url`, `directory`, optionally `hash` with `hash_type: sha256`, as upstream's templates write them),
else h3kit's manifest (workflows/models/manifest.json: Hugging Face repository, path, revision, and size
and sha256 where published). listing.py lists the files the workflows' loaders name (UI and API format,
subgraphs included) against a ComfyUI tree. fetch.py downloads the missing ones.

Nothing here imports huggingface_hub at module level: `h3kit --help` and check-workflow stay light, and
check-workflow's missing-model findings read only the manifest (sources.py).
"""
