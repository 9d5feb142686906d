"""The HTTP routes: OpenAI's, Anthropic's and SGLang's request shapes translated to one internal request, and the
operator routes (health, metrics, debug, control)."""
