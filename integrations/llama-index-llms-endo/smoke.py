"""The installed wheel's smoke test: the local model completes a prompt through LlamaIndex's LLM interface.
Run with `python smoke.py` in a venv holding this distribution."""
from llama_index.core.llms import LLM
from llama_index.llms.endo import EndoLLM

if __name__ == "__main__":
    llm = EndoLLM(max_new_tokens=8)
    assert isinstance(llm, LLM)
    out = llm.complete("The capital of France is")
    assert out.text.strip(), out
    print("llama-index-llms-endo: ok,", repr(out.text))
