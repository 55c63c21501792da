"""seqrl environments and data generators, registered with gymnasium on `import envs`.

POMDP suite (`envs/pomdp.py`):
    seqrl/ThreeStateLine-v0   lecture Problem 21.1: stochastic memoryless policies can be optimal
    seqrl/ShortCorridor-v0    Sutton & Barto Ex. 13.1: switched actions, best memoryless p(right) = 2 - sqrt(2)
    seqrl/TwoDoors-v0         lecture Problem 21.2: a Markovian model p(o'|o,a) is structurally wrong
    seqrl/TMaze-v0            Bakker's T-maze: a cue seen once must be remembered `corridor_length` steps
    seqrl/MaskedCartPole-v0   CartPole-v1 with the two velocities removed from the observation
    seqrl/Tiger-v0            the classic information-gathering POMDP
Language tasks:
    envs/tokenizer.py         the shared word-level `transformers` tokenizer
    envs/preference.py        single-turn preference task: prompts, hidden gold utility, labeler, datasets
    seqrl/GuessTheImage-v0    (`envs/guess_image.py`) multi-turn yes/no-question dialogue + offline dataset writer
"""

from gymnasium.envs.registration import register

NAMESPACE = "seqrl"

register(id=f"{NAMESPACE}/ThreeStateLine-v0", entry_point="envs.pomdp:ThreeStateLineEnv")
register(id=f"{NAMESPACE}/ShortCorridor-v0", entry_point="envs.pomdp:ShortCorridorEnv")
register(id=f"{NAMESPACE}/TwoDoors-v0", entry_point="envs.pomdp:TwoDoorsEnv")
register(id=f"{NAMESPACE}/TMaze-v0", entry_point="envs.pomdp:TMazeEnv")
register(id=f"{NAMESPACE}/MaskedCartPole-v0", entry_point="envs.pomdp:MaskedCartPoleEnv")
register(id=f"{NAMESPACE}/Tiger-v0", entry_point="envs.pomdp:TigerEnv")
register(id=f"{NAMESPACE}/GuessTheImage-v0", entry_point="envs.guess_image:GuessTheImageEnv")
