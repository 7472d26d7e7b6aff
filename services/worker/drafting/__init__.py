"""Drafting: the methods that propose tokens for the target to verify (n-gram, suffix, MTP), what they hand the
engine (drafts and their q), and adaptive speculation, which decides how many drafts each request gets."""
