"""Drafters: every drafting method behind one protocol (protocol.py), one module per family, a
registry of kinds (registry.py): hk.new_drafter, hk.load_drafter, drafter.save."""
from __future__ import annotations

from .amphista import AmphistaConfig, AmphistaDrafter
from .combined import CombinedDrafter
from .config import DrafterConfig
from .draft_heads import DraftHead, HeadDrafter, ResBlock
from .eagle import DynamicTree, EagleDrafter
from .hydra import HydraDrafter
from .lookahead import LookaheadDrafter
from .medusa import MedusaDrafter
from .mlp_speculator import MLPSpeculatorDrafter
from .ngram import NgramDrafter
from .protocol import Drafter, Proposal
from .registry import (FAMILIES, KINDS, SHIPPED_DIR, SHIPPED_MODEL, family, load_drafter, new_drafter,
                       shipped_drafters)

__all__ = ["Drafter", "Proposal", "HeadDrafter", "MedusaDrafter", "HydraDrafter", "EagleDrafter", "DynamicTree", "MLPSpeculatorDrafter",
           "AmphistaDrafter", "AmphistaConfig",
           "NgramDrafter", "LookaheadDrafter", "CombinedDrafter", "DrafterConfig", "DraftHead", "ResBlock", "FAMILIES",
           "KINDS", "SHIPPED_DIR", "SHIPPED_MODEL", "family", "new_drafter", "load_drafter", "shipped_drafters"]
