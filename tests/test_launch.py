"""The launcher's relay of its processes' output: whole lines, Gloo's connection reports
(and their pieces, which its threads interleave) dropped, other lines kept in order."""
import subprocess
import sys

from engine.cli.launch import Relay

CHILD = r"""
import sys
print("[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7")
print("[Gloo] Rank 4 is connected to [Gloo] Rank 5 is connected to 77 peer ranks. Expected number of connected peer ranks is : 7")
print(" peer ranks. Expected number of connected peer ranks is : 7")
print("7")
print("step     1/3 | loss 5.5686")
print("error: something one line", file=sys.stderr)
print("step     2/3 | loss 5.5398")
"""


def run_relay(keep):
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    relay = Relay()
    relay.attach(0, proc)
    proc.wait()
    relay.close(keep)


def test_relay_drops_gloo_chatter_and_keeps_the_rest(capsys):
    run_relay(lambda i: True)
    out, err = capsys.readouterr()
    assert out == "step     1/3 | loss 5.5686\nstep     2/3 | loss 5.5398\n"
    assert err == "error: something one line\n"


def test_relay_drops_the_lines_of_processes_it_is_told_to(capsys):
    run_relay(lambda i: i != 0)
    assert capsys.readouterr() == ("", "")
