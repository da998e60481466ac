# A vLLM replica that liverl can hot-swap: the official vLLM image plus liverl's worker
# extension (serving/inplace.py), which loads new weights in place over vLLM's
# /collective_rpc, and its server entry (serving/replica_server.py), whose streamed answers
# carry routed experts too. Run with vLLM's arguments and --enable-return-routed-experts.
# Built from the repository root: docker build -f serving/replica.Dockerfile .
FROM vllm/vllm-openai:v0.32.0

COPY serving/__init__.py serving/inplace.py serving/replica_server.py /srv/liverl/serving/
ENV PYTHONPATH=/srv/liverl VLLM_SERVER_DEV_MODE=1 VLLM_NO_USAGE_STATS=1
ENTRYPOINT ["python3", "-m", "serving.replica_server"]
