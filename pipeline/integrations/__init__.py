"""Adapters that let agent frameworks call a pipeline as their model.

* `pipeline.integrations.pydantic_ai.PipelineModel`: a Pydantic AI ``Model`` (extra
  ``chat-pipeline[pydantic-ai]``);
* `pipeline.integrations.langchain.PipelineChatModel`: a LangChain ``BaseChatModel`` (extra
  ``chat-pipeline[langchain]``).

An agent built on either framework keeps its own loop, tools and output handling, and gets
the pipeline's failover, breakers and attempt spans by wrapping its model. Each adapter is a
module of its own: importing this package (or `pipeline`) loads neither framework.
"""

__all__: list[str] = []
