"""Tool calling on chat: the tools a request offers, how the model's chat template shows them, the grammar that
makes `required` and named choices exact, and the parsing of calls out of the output, whole or streamed."""
