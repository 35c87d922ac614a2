"""LangChain: an LCEL chain over ContextualCompressionRetriever(EndoDocumentCompressor) and ChatEndo.

The retriever returns evidence spans, the compressor cuts them to one token budget with the model's own attention
signals, and the same local model answers. Runs offline on the embedded default model.
"""
from langchain_classic.retrievers import ContextualCompressionRetriever
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from langchain_endo import ChatEndo, EndoDocumentCompressor, EndoRetriever

TEXTS = [
    "The Zephyr bridge crosses the Varna river. It was painted bright green in 1932 by the city council. "
    "Tourists photograph it at sunset.",
    "The Orion cafe serves espresso and cardamom buns. It opens at seven in the morning every weekday. "
    "Its owner is Jonas Berg.",
    "The research ship Albatross carries twelve scientists. Its home port is Gdansk on the Baltic coast. "
    "It was launched in 1988.",
]
QUESTION = "What color was the Zephyr bridge painted?"
PROMPT = ChatPromptTemplate.from_messages([
    ("user", "Answer the question using the context.\n\nContext:\n{context}\n\nQuestion: {question}")])


def main() -> str:
    retriever = ContextualCompressionRetriever(base_compressor=EndoDocumentCompressor(budget=48),
                                               base_retriever=EndoRetriever(texts=TEXTS, k=3))
    chain = ({"context": retriever | (lambda docs: "\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()}
             | PROMPT | ChatEndo(max_new_tokens=32) | StrOutputParser())
    answer = chain.invoke(QUESTION)
    print(f"Q: {QUESTION}\nA: {answer}")
    return answer


if __name__ == "__main__":
    main()
