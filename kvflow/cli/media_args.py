"""The image flags of `kvflow serve` and `kvflow frontend` (vLLM's names): where chat
images may come from (kvflow/media.py) and how many and how large they may be."""

from __future__ import annotations

import argparse
import json

from kvflow.image_inputs import DEFAULT_MAX_IMAGE_PIXELS, ImageLimits
from kvflow.media import MediaOptions


def add_media_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        help="hosts whose http(s) image URLs the server may fetch (default: none; "
        "data: URLs are always taken)",
    )
    group.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a directory whose files chat may name as file:// image URLs (default: none)",
    )
    group.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        help="images per prompt, as JSON: '{\"image\": N}' (default 8)",
    )
    group.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help="largest image (width x height) a request may send, checked before decoding",
    )


def resolve_media(args: argparse.Namespace) -> MediaOptions:
    """The flags as the frontend's options; a bad value exits before anything starts."""
    try:
        limits = json.loads(args.limit_mm_per_prompt) if args.limit_mm_per_prompt else None
        if limits is not None and not isinstance(limits, dict):
            raise ValueError("expected a JSON object")
        image_limits = ImageLimits.from_mm_limits(limits, args.max_image_pixels)
    except ValueError as exc:
        raise SystemExit(f"kvflow: --limit-mm-per-prompt: {exc}") from None
    return MediaOptions(
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        allowed_local_media_path=args.allowed_local_media_path,
        limits=image_limits,
    )
