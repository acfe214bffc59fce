"""Model code that ``pipetransformer export`` ships inside an exported directory, so ``transformers`` loads a text
classifier whose head no standard class has (pooling over tokens, then one linear layer) with
``trust_remote_code=True``. These modules import ``transformers`` and ``torch`` only: the export runs without this
package installed."""
