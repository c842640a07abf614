"""ROS 2 deployment of the exported policies: nodes, safety layer, launch runner, recorder (see README.md)."""
