"""An agent that looks facts up with the endogenous retriever, as a LangChain tool (`create_retriever_tool`).

`create_agent` runs the model -> tool -> model loop; ChatEndo's tool policy (see langchain_endo.chat_models) calls
the search tool on the user's question and then answers from what it returned. Runs offline.
"""
from langchain.agents import create_agent
from langchain_core.tools import create_retriever_tool

from langchain_endo import ChatEndo, EndoRetriever

TEXTS = [
    "Marta Kowal is a chemist from Lodz. She discovered the compound lodzite in 1971. "
    "She later taught at Warsaw university.",
    "The Orion cafe serves espresso and cardamom buns. It opens at seven in the morning every weekday. "
    "Its owner is Jonas Berg.",
    "The research ship Albatross carries twelve scientists. Its home port is Gdansk on the Baltic coast. "
    "It was launched in 1988.",
]
QUESTION = "When does the Orion cafe open?"


def main() -> str:
    search = create_retriever_tool(EndoRetriever(texts=TEXTS, k=1), "search_facts",
                                   "Search the fact sheets for evidence. Input: the question.")
    agent = create_agent(ChatEndo(max_new_tokens=32), tools=[search])
    state = agent.invoke({"messages": [("user", QUESTION)]})
    for message in state["messages"]:
        print(f"[{message.type}] {message.content or message.tool_calls}")
    answer = state["messages"][-1].content
    print(f"Q: {QUESTION}\nA: {answer}")
    return answer


if __name__ == "__main__":
    main()
