"""Package version. The engine speaks vLLM's public interface; this is our own release number."""

__version__ = "0.1.0"
