"""Lets the fuzz tests import detok_support.py whatever pytest's import mode."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
